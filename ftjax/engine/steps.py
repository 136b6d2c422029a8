"""The compiled programs of a loaded model: prefill and the decode step.

Both are `jax.jit` over the split NNX state (`nnx.merge` inside the trace; calling
`nnx.jit` per token costs ~10x more dispatch), taken as the flat tuple of its arrays
(`param_leaves`): JAX flattens a tuple of arrays in C++, an NNX state through Python
callbacks (~50 us a call on the default model's 56 params). The layers' state (a tuple
of per-layer pytrees, `models.common.init_state`) and the executor state are donated, so
they update in place; the host pool view is a plain (read-only) argument. Shapes are bucketed by
the caller, so each program compiles once per (batch, token bucket, state capacity).

Every row of a batch carries its own position: `start [B]` for prefill, `pos [B]` for
decode, and an `active [B]` mask (decode) so finished or padding rows neither count
in the executor's records nor disturb its cache. Sampling settings are per row too.

Per step the executor writes `codes [Lm, E]` (hit / fetched / host per expert); the
step returns them as a separate output so the engine can keep a device-side log
without a host sync.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ftjax import host
from ftjax.engine.sampling import apply_bias, sample
from ftjax.experts.executor import Executor  # or experts.parallel.ExpertParallel: the same interface


class Steps:
    def __init__(self, graphdef, executor: Executor, threads: int | None = None, dense_isa: host.Isa = host.Isa.AUTO):
        self.graphdef, self.executor = graphdef, executor
        self.param_tree = None  # the structure of the params the steps take flat (param_leaves)
        self.threads, self.dense_isa = threads, dense_isa  # the dense host kernel's (host.dense_settings)
        self.prefill = jax.jit(self._prefill, donate_argnums=(1, 2), static_argnames=("all_logits",))
        self.decode = jax.jit(self._decode, donate_argnums=(1, 2))

    def param_leaves(self, params) -> tuple:
        """The params as the steps take them: their arrays, flat; the structure is kept
        (one model's steps serve one param structure)."""
        leaves, tree = jax.tree.flatten(params)
        if self.param_tree is not None and tree != self.param_tree:
            raise ValueError("these steps were traced for params of another structure")
        self.param_tree = tree
        return tuple(leaves)

    def _forward(self, params, state, xstate, pool, tokens, start, valid, logits_at, prompt: bool = True):
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self.param_tree, params))
        E = self.executor

        def experts(layer, x, ids, w, ok, st):
            return E(layer, x, ids, w, ok, st, pool)

        xstate = {**xstate, "codes": E.fresh_codes()}
        with host.dense_settings(self.threads, self.dense_isa, prompt):  # decode: no tiles (host.call_isa)
            logits, state, xstate = model(tokens, start, valid, state, experts, xstate, logits_at)
        codes = E.merged_codes(xstate.pop("codes"))
        return logits, state, xstate, codes

    def _prefill(self, params, state, xstate, pool, tokens, start, length, all_logits: bool = False):
        """tokens [B, T] (padded) from start [B]; length [B] real tokens per row ->
        logits ([B, T, V], or [B, V] at each row's last real token)."""
        B, T = tokens.shape
        valid = jnp.arange(T)[None, :] < length[:, None]  # [B, T]
        logits_at = None if all_logits else jnp.maximum(length - 1, 0)
        logits, state, xstate, codes = self._forward(params, state, xstate, pool, tokens, start, valid, logits_at)
        return (logits if all_logits else logits[:, 0]), state, xstate, codes

    def _decode(self, params, state, xstate, pool, token, pos, active, keys, counters, temperature, top_k, top_p,
                bias_ids, bias_values):
        """token [B] at positions pos [B] (rows with active [B] False are ignored) ->
        next token [B], logits [B, V] (before the bias). Row b samples with
        fold_in(keys[b], counters[b]) from its logits + its bias (ids / values [B, K])."""
        valid = active[:, None]  # [B, 1]
        logits, state, xstate, codes = self._forward(params, state, xstate, pool, token[:, None], pos, valid, None,
                                                     prompt=False)
        logits = logits[:, 0]
        step_keys = jax.vmap(jax.random.fold_in)(keys, counters)
        nxt = sample(apply_bias(logits, bias_ids, bias_values), step_keys, temperature, top_k, top_p)
        return nxt, logits, state, xstate, codes
