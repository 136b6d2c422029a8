"""Streamed prefill: each MoE layer's experts go host->device as one block, double
buffered, while the previous layer computes.

    time ──────────────────────────────────────────────►
    link:    [send block 0][send block 1][send block 2] ...
    device:                [layer 0     ][layer 1     ][layer 2] ...

A long prompt touches almost every expert of every layer, so the per-record cache
bookkeeping of the cached path buys nothing; moving whole layers costs one pass of the
expert pool over the link, and with two buffers in flight T ≈ max(T_transfer, T_compute).

Mechanics: the prompt runs layer by layer, one jitted call per decoder layer (compiled
once per layer and prompt bucket), dispatched asynchronously; the block of MoE layer m+1
is handed to `jax.device_put(..., may_alias=False)` (an asynchronous copy) right after
layer m is dispatched, so at most two blocks are alive. Experts already resident in the
decode cache are not resent (the block carries only the others) and run from their
slots; the decode cache, stamps and counter are untouched. Records appear in
`expert_log()` with phase "prefill": resident experts as hits, the rest as "streamed".

When to stream (`stream_threshold`): a prompt of T tokens routed top-K over E experts
touches E·(1−(1−K/E)^T) experts per layer in expectation; we stream once that covers
`STREAM_COVERAGE` of the layer, i.e. T ≥ log(1−c)/log(1−K/E). `calibrate` measures the
real crossover on this machine (`Model.calibrate_prefill`: cached vs streamed time per
prompt bucket) and overrides it.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ftjax.experts.executor import Executor

STREAM_COVERAGE = 0.9


def stream_threshold(num_experts: int, top_k: int, coverage: float = STREAM_COVERAGE) -> int:
    """Smallest prompt length whose expected routed coverage of a layer is >= coverage."""
    if top_k >= num_experts:
        return 1
    return max(1, math.ceil(math.log(1.0 - coverage) / math.log(1.0 - top_k / num_experts)))


class StreamedPrefill:
    def __init__(self, graphdef, executor: Executor, moe_layers: tuple[bool, ...]):
        self.graphdef, self.executor, self.moe_layers = graphdef, executor, moe_layers
        self._embed = jax.jit(self._embed_fn)
        self._layer = jax.jit(self._layer_fn, static_argnames=("layer",), donate_argnums=(1,))
        self._head = jax.jit(self._head_fn, static_argnames=("all_logits",))

    # ---- jitted pieces ------------------------------------------------------------------------
    def _embed_fn(self, params, tokens):
        return nnx.merge(self.graphdef, params).embed_tokens(tokens)

    def _layer_fn(self, params, kv, xstate, x, block, start, length, layer: int):
        model = nnx.merge(self.graphdef, params)
        B, T, _ = x.shape
        positions, rope = model.positions(start, B, T)
        valid = jnp.broadcast_to(jnp.arange(T) < length, (B, T))
        E = self.executor

        def experts(m, x, ids, w, ok, st):
            return E.streamed(m, x, ids, w, ok, st, block)

        st = {**xstate, "codes": jnp.zeros((E.num_layers, E.num_experts), jnp.int8)}
        x, kv, st = model.layers[layer](x, positions, start, valid, rope, kv, experts, st)
        return x, kv, st["codes"]

    def _head_fn(self, params, x, length, all_logits: bool):
        model = nnx.merge(self.graphdef, params)
        if all_logits:
            return model.head(x)
        return model.head(x, jnp.full((x.shape[0],), length - 1, jnp.int32))[:, 0]

    # ---- host side ------------------------------------------------------------------------------
    def blocks(self, pool, xstate):
        """Per MoE layer: a function that starts the layer's transfer, and its bytes."""
        E = self.executor.num_experts
        resident = np.zeros((pool.num_layers, E), bool)
        if self.executor.policy.uses_slots:
            resident = np.asarray(xstate["slot_of"]).reshape(pool.num_layers, E) >= 0

        def send(m):
            gu, dn = pool.gate_up[m], pool.down[m]
            if resident[m].any():  # resident experts are not resent: gather the others
                keep = ~resident[m]
                gu, dn = np.where(keep[:, None, None], gu, 0).astype(gu.dtype), np.where(keep[:, None, None], dn, 0).astype(dn.dtype)
            # device_put of aligned host memory aliases on the CPU backend; the second put
            # is the real (asynchronous) copy into a device buffer.
            return {"gate_up": jax.device_put(jax.device_put(gu), may_alias=False),
                    "down": jax.device_put(jax.device_put(dn), may_alias=False)}

        nbytes = [int((~resident[m]).sum()) * pool.expert_bytes for m in range(pool.num_layers)]
        return send, nbytes

    def run(self, params, kv, xstate, pool, tokens, length, all_logits=False, preloaded=None):
        """tokens [B, T] padded, length real tokens -> (logits, kv, codes [Lm, E], bytes sent)."""
        send, nbytes = self.blocks(pool, xstate)
        moe_ids = [i for i, is_moe in enumerate(self.moe_layers) if is_moe]
        start, n = jnp.int32(0), jnp.int32(length)
        x = self._embed(params, tokens)
        blocks = dict(preloaded) if preloaded else {0: send(0)} if moe_ids else {}
        rows, m = [], 0
        for i, is_moe in enumerate(self.moe_layers):
            block = None
            if is_moe:
                block = blocks.pop(m)
            x, kv, codes = self._layer(params, kv, xstate, x, block, start, n, layer=i)
            if is_moe:
                rows.append(codes[m])
                m += 1
                if m < len(moe_ids) and m not in blocks:
                    blocks[m] = send(m)  # double buffer: the next layer's block is in flight
        logits = self._head(params, x, n, all_logits=all_logits)
        codes = jnp.stack(rows) if rows else jnp.zeros((0, self.executor.num_experts), jnp.int8)
        return logits, kv, codes, sum(nbytes)

    def breakdown(self, params, make_kv, xstate, pool, tokens, length) -> dict[str, float]:
        """T_prefill (pipelined), T_transfer alone, T_compute alone (blocks preloaded)."""
        send, nbytes = self.blocks(pool, xstate)
        Lm = sum(self.moe_layers)
        jax.block_until_ready(self.run(params, make_kv(), xstate, pool, tokens, length)[0])  # compile
        t0 = time.perf_counter()
        jax.block_until_ready(self.run(params, make_kv(), xstate, pool, tokens, length)[0])
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        for m in range(Lm):
            jax.block_until_ready(send(m))
        t_transfer = time.perf_counter() - t0
        pre = {m: send(m) for m in range(Lm)}
        jax.block_until_ready(pre)
        t0 = time.perf_counter()
        jax.block_until_ready(self.run(params, make_kv(), xstate, pool, tokens, length, preloaded=pre)[0])
        t_compute = time.perf_counter() - t0
        return {"t_prefill_s": t_prefill, "t_transfer_s": t_transfer, "t_compute_s": t_compute,
                "overlap_ratio": t_prefill / max(t_transfer, t_compute), "bytes_sent": sum(nbytes),
                "tokens": int(length)}
