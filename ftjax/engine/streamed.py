"""Streamed prefill: each MoE layer's experts go host->device as one block, double
buffered, while the previous layer computes.

    time ──────────────────────────────────────────────►
    link:    [send block 0][send block 1][send block 2] ...
    device:                [layer 0     ][layer 1     ][layer 2] ...

A long prompt touches almost every expert of every layer, so the per-record cache
bookkeeping of the cached path buys nothing; moving whole layers costs one pass of the
expert pool over the link, and with two buffers in flight T ≈ max(T_transfer, T_compute).

Mechanics: the prompt runs layer by layer, one jitted call per decoder layer (compiled
once per layer and prompt bucket), dispatched asynchronously. A layer block is a
device buffer [E, ...] per expert part; two of them alternate (double buffering). Only
the experts NOT resident in the decode cache cross the link: the pool rows of each
contiguous run of non-resident experts are a zero-copy view of host memory, sent with
an asynchronous `device_put` (exactly their bytes) and placed into the block with an
in-place `dynamic_update_slice` (one tiny program per run length, compiled once).
Resident experts run from their cache slots; their block rows are stale and never read.
The decode cache, stamps and counter are untouched. Records appear in `expert_log()`
with phase "prefill": resident experts as hits, the rest as "streamed".

When to stream (`Model.streams`): never where the device is the host (the CPU backend:
"transferring" would copy RAM to RAM, and the host kernels already read the pool in
place); elsewhere from `stream_threshold` tokens. A prompt of T tokens routed top-K over
E experts touches E·(1−(1−K/E)^T) experts per layer in expectation; the default
threshold streams once that covers `STREAM_COVERAGE` of the layer, and
`ftjax.bench.prefill.calibrate_prefill` measures the real crossover on a machine.
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ftjax import host
from ftjax.experts.executor import Executor

STREAM_COVERAGE = 0.9


def stream_threshold(num_experts: int, top_k: int, coverage: float = STREAM_COVERAGE) -> int:
    """Smallest prompt length whose expected routed coverage of a layer is >= coverage."""
    if top_k >= num_experts:
        return 1
    return max(1, math.ceil(math.log(1.0 - coverage) / math.log(1.0 - top_k / num_experts)))


def runs_of(mask: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous runs of True in a 1-D mask -> [(first, length)]."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]


@functools.partial(jax.jit, donate_argnums=(0,))
def _place(block, run, first):
    """block [E, ...] with rows first.. <- run [n, ...] per part, in place (block donated)."""
    return {k: jax.lax.dynamic_update_slice_in_dim(block[k], run[k], first, axis=0) for k in block}


class StreamedPrefill:
    def __init__(self, graphdef, executor: Executor, moe_layers: tuple[bool, ...], threads: int | None = None,
                 dense_isa: host.Isa = host.Isa.AUTO):
        self.graphdef, self.executor, self.moe_layers = graphdef, executor, moe_layers
        self.threads, self.dense_isa = threads, dense_isa  # the dense host kernel's (host.dense_settings)
        self._embed = jax.jit(self._embed_fn)
        self._layer = jax.jit(self._layer_fn, static_argnames=("layer",), donate_argnums=(1,))
        self._head = jax.jit(self._head_fn, static_argnames=("all_logits",))
        self._buffers: list | None = None  # two device blocks [E, ...] per part, reused

    # ---- jitted pieces ------------------------------------------------------------------------
    def _embed_fn(self, params, tokens):
        return nnx.merge(self.graphdef, params).embed_tokens(tokens)

    def _layer_fn(self, params, layer_state, xstate, x, block, start, length, layer: int):
        model = nnx.merge(self.graphdef, params)
        B, T, _ = x.shape
        valid = jnp.arange(T)[None, :] < length[:, None]
        step = model.step(start, valid)
        E = self.executor

        def experts(m, x, ids, w, ok, st):
            return E.streamed(m, x, ids, w, ok, st, block)

        st = {**xstate, "codes": jnp.zeros((E.num_layers, E.num_experts), jnp.int8)}
        with host.dense_settings(self.threads, self.dense_isa):
            x, layer_state, st = model.layers[layer](x, step, layer_state, experts, st)
        return x, layer_state, st["codes"]

    def _head_fn(self, params, x, length, all_logits: bool):
        model = nnx.merge(self.graphdef, params)
        with host.dense_settings(self.threads, self.dense_isa):
            return model.head(x) if all_logits else model.head(x, jnp.maximum(length - 1, 0))[:, 0]

    # ---- host side ------------------------------------------------------------------------------
    def _blocks(self, parts):
        if self._buffers is None:
            self._buffers = [{k: jnp.zeros(a.shape[1:], a.dtype) for k, a in parts.items()} for _ in range(2)]
        return self._buffers

    def sender(self, pool, xstate):
        """-> (send(m, buffer_index) -> device block of MoE layer m, bytes sent per layer).

        Only non-resident experts are sent, as one asynchronous transfer per contiguous run."""
        parts = pool.parts
        E = self.executor.num_experts
        resident = np.zeros((pool.num_layers, E), bool)
        if self.executor.policy.uses_slots:
            resident = np.asarray(xstate["slot_of"]).reshape(pool.num_layers, E) >= 0
        runs = [runs_of(~resident[m]) for m in range(pool.num_layers)]
        nbytes = [sum(n for _, n in r) * pool.expert_bytes for r in runs]

        def send(m, i):
            block = self._blocks(parts)[i]
            for first, n in runs[m]:
                # numpy views of the pool: device_put reads them in place (aligned host memory)
                run = jax.device_put({k: a[m, first:first + n] for k, a in parts.items()}, may_alias=False)
                block = _place(block, run, jnp.int32(first))
            self._buffers[i] = block
            return block

        return send, nbytes

    def run(self, params, state, xstate, pool, tokens, start, length, all_logits=False, preloaded=None):
        """tokens [1, T] padded from start [1], length [1] real tokens ->
        (logits, state, codes [Lm, E], bytes sent)."""
        send, nbytes = self.sender(pool, xstate)
        moe_ids = [i for i, is_moe in enumerate(self.moe_layers) if is_moe]
        x = self._embed(params, tokens)
        blocks = dict(preloaded) if preloaded else {0: send(0, 0)} if moe_ids else {}
        rows, m, new_state = [], 0, list(state)
        for i, is_moe in enumerate(self.moe_layers):
            block = blocks.pop(m) if is_moe else None
            x, new_state[i], codes = self._layer(params, new_state[i], xstate, x, block, start, length, layer=i)
            if is_moe:
                rows.append(codes[m])
                m += 1
                if m < len(moe_ids) and m not in blocks:
                    blocks[m] = send(m, m % 2)  # double buffer: the next layer's block is in flight
        logits = self._head(params, x, length, all_logits=all_logits)
        codes = jnp.stack(rows) if rows else jnp.zeros((0, self.executor.num_experts), jnp.int8)
        return logits, tuple(new_state), codes, sum(nbytes)

    def breakdown(self, params, make_state, xstate, pool, tokens, start, length) -> dict[str, float]:
        """T_prefill (pipelined), T_transfer alone, T_compute alone (blocks preloaded)."""
        send, nbytes = self.sender(pool, xstate)
        Lm = sum(self.moe_layers)
        args = (xstate, pool, tokens, start, length)
        jax.block_until_ready(self.run(params, make_state(), *args)[0])  # compile
        t0 = time.perf_counter()
        jax.block_until_ready(self.run(params, make_state(), *args)[0])
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        for m in range(Lm):
            jax.block_until_ready(send(m, m % 2))
        t_transfer = time.perf_counter() - t0
        # compute alone: every block already on the device (its own copy per layer)
        pre = {m: jax.tree.map(jnp.copy, send(m, m % 2)) for m in range(Lm)}
        jax.block_until_ready(pre)
        t0 = time.perf_counter()
        jax.block_until_ready(self.run(params, make_state(), *args, preloaded=pre)[0])
        t_compute = time.perf_counter() - t0
        return {"t_prefill_s": t_prefill, "t_transfer_s": t_transfer, "t_compute_s": t_compute,
                "overlap_ratio": t_prefill / max(t_transfer, t_compute), "bytes_sent": sum(nbytes),
                "tokens": int(np.asarray(length)[0])}
