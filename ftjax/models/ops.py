"""Building blocks every layer kind shares: parameters, the `linear` that dispatches on
weight storage, RMSNorm, RoPE, and `Step`, the per-call context a layer reads.

Linear weights are stored [in, out] (x @ W), or *packed*: bf16 bits (uint16) in the HF
layout [out, in], multiplied by the host GEMV kernel on the CPU backend
(`ftjax.host.linear`). Letters as in `ftjax.models.common`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ftjax import host


class Step(NamedTuple):
    """What one forward call tells every layer (a pytree of traced arrays).

    positions [B, T] absolute position of each query token; start [B] position of the
    first one (where this call's keys/values or recurrent steps begin, per row); valid
    [B, T] real (non-padding, active-row) tokens; rope (cos, sin) [B, T, hd]."""

    positions: jax.Array
    start: jax.Array
    valid: jax.Array
    rope: tuple[jax.Array, jax.Array]


def param(shape: tuple[int, ...], dtype) -> nnx.Param:
    # Placeholders: real values come from the checkpoint (or an init function).
    return nnx.Param(jnp.zeros(shape, dtype))


def linear_param(d_in: int, d_out: int, dtype, packed: bool) -> nnx.Param:
    return param((d_out, d_in), jnp.uint16) if packed else param((d_in, d_out), dtype)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] -> [..., out]; w float [in, out], or packed uint16 [out, in]."""
    if w.dtype == jnp.uint16:
        return host.linear(x, w).astype(x.dtype)
    return x @ w


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((size,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, hd] for the default (non-scaled) rotary embedding."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, heads, hd]; rotate-half convention (as HF)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


