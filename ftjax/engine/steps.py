"""The compiled programs of a loaded model: prefill and the decode step.

Both are `jax.jit` over the split NNX state (`nnx.merge` inside the trace; calling
`nnx.jit` per token costs ~10x more dispatch). The KV cache and the executor state
are donated, so they update in place; the host pool view is a plain (read-only)
argument. Shapes are bucketed by the caller, so each program compiles once per
(prompt bucket, cache length).

Per step the executor writes `codes [Lm, E]` (hit / fetched / host per expert); the
step returns them as a separate output so the engine can keep a device-side log
without a host sync.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx

from ftjax.engine.sampling import sample
from ftjax.experts.executor import Executor


class Steps:
    def __init__(self, graphdef, executor: Executor):
        self.graphdef, self.executor = graphdef, executor
        self.prefill = jax.jit(self._prefill, donate_argnums=(1, 2), static_argnames=("all_logits",))
        self.decode = jax.jit(self._decode, donate_argnums=(1, 2))

    def _forward(self, params, kv, xstate, pool, tokens, start, valid, logits_at):
        model = nnx.merge(self.graphdef, params)
        E = self.executor

        def experts(layer, x, ids, w, ok, st):
            return E(layer, x, ids, w, ok, st, pool)

        xstate = {**xstate, "codes": jnp.zeros((E.num_layers, E.num_experts), jnp.int8)}
        logits, kv, xstate = model(tokens, start, valid, kv, experts, xstate, logits_at)
        codes = xstate.pop("codes")
        return logits, kv, xstate, codes

    def _prefill(self, params, kv, xstate, pool, tokens, start, length, all_logits: bool = False):
        """tokens [B, T] (padded); length [] real tokens -> logits ([B, T, V] or [B, V])."""
        B, T = tokens.shape
        valid = jnp.broadcast_to(jnp.arange(T) < length, (B, T))
        logits_at = None if all_logits else jnp.full((B,), length - 1, jnp.int32)
        logits, kv, xstate, codes = self._forward(params, kv, xstate, pool, tokens, start, valid, logits_at)
        return (logits if all_logits else logits[:, 0]), kv, xstate, codes

    def _decode(self, params, kv, xstate, pool, token, pos, key, temperature, top_k, top_p):
        """token [B] at position pos -> next token [B], logits [B, V]."""
        B = token.shape[0]
        valid = jnp.ones((B, 1), bool)
        logits, kv, xstate, codes = self._forward(params, kv, xstate, pool, token[:, None], pos, valid, None)
        logits = logits[:, 0]
        nxt = sample(logits, key, temperature, top_k, top_p)
        return nxt, logits, kv, xstate, codes
