"""Token sampling inside the jitted step: greedy, or seeded temperature / top-k / top-p.

The sampling settings are traced scalars, so changing them never recompiles; greedy
(temperature 0) is a branch of the same program. The key for step i is
fold_in(PRNGKey(seed), i), so a seeded run is reproducible token for token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits [B, V] f32 -> token ids [B] int32. top_k 0 = off; top_p 1.0 = off."""

    def stochastic(logits):
        scaled = logits / jnp.maximum(temperature, 1e-6)
        sorted_desc = jnp.sort(scaled, axis=-1)[:, ::-1]  # [B, V]
        V = logits.shape[-1]
        k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
        kth = jnp.take_along_axis(sorted_desc, jnp.broadcast_to(k - 1, (logits.shape[0], 1)), axis=-1)
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
        # top-p: keep the smallest prefix of the sorted distribution with mass >= top_p
        probs_sorted = jax.nn.softmax(jnp.where(sorted_desc < kth, -jnp.inf, sorted_desc), axis=-1)
        mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
        keep_sorted = mass_before < top_p
        cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
        return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)

    greedy = lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32)  # noqa: E731
    return jax.lax.cond(temperature > 0, stochastic, greedy, logits)
