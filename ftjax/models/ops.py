"""Building blocks every layer kind shares: parameters, the `linear` that dispatches on
weight storage, RMSNorm, RoPE, and `Step`, the per-call context a layer reads.

Linear weights are stored [in, out] (x @ W), or *packed*: bf16 bits (uint16) in the HF
layout [out, in], multiplied by the host GEMV kernel on the CPU backend
(`ftjax.host.linear`), or *quantised*: a `QuantMatrix`, a block format's uint8 rows
[out, row bytes] (GGUF's Q8_0 / Q4_0 / Q4_K / Q6_K / MXFP4 blocks, `ftjax.experts.storage`)
with the format's name, multiplied by the same kernel with int8-quantised activations.

A `QuantMatrix` is a small pytree: its one leaf is the uint8 array, its format name is
static (part of the tree structure), so a program traced with it knows the format at
trace time and one compile serves every matrix of the format and shape. It is held as an
nnx.Param's value like any array, and `param[...]` gives it back whole, so layers call
`linear(x, self.wq[...])` whatever the storage. Which matrices the loaders quantise is
`ftjax.checkpoint.quantisable`: the HF Linear weights that only ever reach `linear`
(embedding, routers, shared-expert gates, MLA's kv_b and DeepSeek-V4's o_a stay float).
Letters as in `ftjax.models.common`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ftjax import host
from ftjax.config import RopeScaling
from ftjax.experts.storage import FORMATS, K_ACT_BLOCK, as_f32


class Step(NamedTuple):
    """What one forward call tells every layer (a pytree of traced arrays).

    positions [B, T] absolute position of each query token; start [B] position of the
    first one (where this call's keys/values or recurrent steps begin, per row); valid
    [B, T] real (non-padding, active-row) tokens; rope (cos, sin) [B, T, hd]."""

    positions: jax.Array
    start: jax.Array
    valid: jax.Array
    rope: tuple[jax.Array, jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantMatrix:
    """A dense matrix [N, K] stored in a block format: data uint8 [N, row bytes] (each row
    K / block weights blocks, GGUF's bytes), fmt its `storage.FORMATS` name (static)."""

    data: jax.Array  # uint8 [N, row bytes]
    fmt: str = dataclasses.field(metadata=dict(static=True))

    def __post_init__(self):
        f = FORMATS.get(self.fmt)
        if f is None or f.block == 1:
            raise ValueError(f"{self.fmt!r} is not a block format "
                             f"({', '.join(n for n, g in FORMATS.items() if g.block > 1)})")

    def __getitem__(self, key):  # nnx.Param(...)[...] -> the whole matrix
        if key is not Ellipsis:
            raise TypeError("a QuantMatrix is indexed whole ([...]); dequantise it to slice rows")
        return self

    @property
    def shape(self) -> tuple[int, int]:
        """Logical [N, K] (in weights, not bytes)."""
        return self.data.shape[0], FORMATS[self.fmt].row_len(self.data.shape[1])

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def to_f32(self) -> jax.Array:
        """[N, K] float32 (XLA: the format's `to_f32`)."""
        return FORMATS[self.fmt].to_f32(self.data)


def param(shape: tuple[int, ...], dtype) -> nnx.Param:
    # Placeholders: real values come from the checkpoint (or an init function).
    return nnx.Param(jnp.zeros(shape, dtype))


def linear_param(d_in: int, d_out: int, dtype, packed: bool) -> nnx.Param:
    return param((d_out, d_in), jnp.uint16) if packed else param((d_in, d_out), dtype)


PACKED_GEMM_MIN_TOKENS = 128  # from this many rows, XLA's GEMM on the f32 view beats the GEMV kernel (measured)
PACKED_GEMM_MAX_BYTES = 512 << 20  # ... unless the f32 view would be this big (an LM head over all prompt logits)


def linear(x: jax.Array, w: jax.Array | QuantMatrix) -> jax.Array:
    """x [..., in] -> [..., out]; w float [in, out], packed uint16 [out, in], or a
    `QuantMatrix` [out, in] (quantised: the same rule as packed weights, the widened
    matrix being XLA's dequantisation of it; the activations are int8-rounded as the
    kernel's on every path, `host.linear`. At 512 rows of a 2048 x 2048 Q8_0 matrix: kernel
    111 ms, XLA 66 ms on an AVX2 EPYC; 25.8 vs 23.2 ms at 2 threads on Zen 4. The K
    super-block formats always take the kernel: with one activation scale per 256 it beats
    XLA at every row count measured, Q4_K 512 rows 19.3 vs 22.4 ms, Q6_K 17.7 vs 27.8,
    128 rows 4.9 vs 7.5 and 4.5 vs 12.9).

    Packed weights: a few rows (decode, short prompts) stream the bf16 matrix through
    the host GEMV kernel at memory speed; from `PACKED_GEMM_MIN_TOKENS` rows (prompt
    chunks) the matrix is widened to f32 once and multiplied by XLA's GEMM, which reuses
    each weight across rows (at 512 rows of a 4096 x 2048 matrix: 120 ms vs 314 ms),
    unless the kernel multiplies them on the bf16 tiles (numerics="fast" on an AMX or
    AVX512-BF16 CPU), which beat that GEMM. A matrix whose f32 view would exceed
    `PACKED_GEMM_MAX_BYTES` (a large-vocabulary LM head when every prompt position's
    logits are asked for) stays on the kernel.
    On an accelerator, packed weights go to its own bf16 matmul (`bf16_matmul`)."""
    if isinstance(w, QuantMatrix):
        fmt = FORMATS[w.fmt]
        if jax.default_backend() != "cpu" or (fmt.act_block != K_ACT_BLOCK and _gemm_wins(x, w.shape, w.fmt)):
            # XLA dequantises
            return (fmt.act(x.astype(jnp.float32)) @ w.to_f32().T).astype(x.dtype)
        return host.linear(x, w.data, wtype=w.fmt).astype(x.dtype)
    if w.dtype == jnp.uint16:
        if jax.default_backend() != "cpu":
            return bf16_matmul(x, w).astype(x.dtype)
        if _gemm_wins(x, w.shape, "bfloat16"):
            return (x.astype(jnp.float32) @ as_f32(w).T).astype(x.dtype)
        return host.linear(x, w).astype(x.dtype)
    return x @ w


def _gemm_wins(x: jax.Array, shape: tuple[int, int], wtype: str) -> bool:
    """Whether XLA's GEMM on the widened f32 matrix [out, in] of `wtype` beats the host
    kernel for x's rows (see `linear`): enough rows to reuse each weight, an f32 view that
    is not too big, and a kernel call that would not run on the bf16 tiles (numerics="fast"
    on an AMX or AVX512-BF16 CPU, `host.dense_settings`: the tiles beat XLA's f32 GEMM at
    every row count — OLMoE geometry prefill-512, bf16, 2 Zen 4 threads: XLA's GEMMs were
    29% of the samples)."""
    rows = math.prod(x.shape[:-1])
    return (rows >= PACKED_GEMM_MIN_TOKENS and 4 * math.prod(shape) <= PACKED_GEMM_MAX_BYTES
            and not host.linear_takes_tiles(host.call_isa(host.dense_isa()), rows, shape[0], shape[1], wtype))


def bf16_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ packed w [out, in] (bf16 bits) -> [..., out] float32 with the
    backend's bf16 matmul: the bits are reinterpreted (a bitcast, no copy), x is rounded
    to bf16, products accumulate in f32. The weight is never widened to an f32 copy."""
    wb = jax.lax.bitcast_convert_type(w, jnp.bfloat16)
    return jax.lax.dot_general(x.astype(jnp.bfloat16), wb, (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


# rms_norm and apply_rope are jitted: a step traces and lowers each once for all the
# layers that call it with the same shapes (XLA inlines the calls; the program is the same).
@functools.partial(jax.jit, static_argnames=("eps", "offset"))
def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMS-normalise the last axis and scale by (offset + weight): offset 1 is the
    zero-centred form of Qwen3-Next / Qwen3.5 (computed in f32 there, as HF does)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (x32 * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, dtype=jnp.float32, offset: float = 0.0):
        self.weight = nnx.Param(jnp.full((size,), 1.0 - offset, dtype))  # identity at init
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, self.offset)


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float,
                 scaling: RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, rd] for the rotary embedding over the first rd = rotary_dim dims
    of a head (rd = hd unless the rotary is partial): the default RoPE, or YaRN
    (`yarn_inv_freq`, cos and sin times its attention factor) when `scaling` is given."""
    if scaling is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    else:
        inv_freq = jnp.asarray(yarn_inv_freq(rotary_dim, theta, scaling))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rd/2]
    # each angle once, then duplicated: on the duplicated [B, T, rd] XLA's CPU backend called libm's scalar
    # sincosf per element (8% of the default model's 2k-token prompt); on [B, T, rd/2] it vectorises them
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    if scaling is not None:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)


def yarn_inv_freq(dim: int, theta: float, y: RopeScaling) -> np.ndarray:
    """YaRN inverse frequencies [dim/2] float32, as transformers' `_compute_yarn_parameters`:
    dims rotating fewer than beta_slow times over the original context are interpolated
    (divided by the factor), more than beta_fast times kept, a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(y.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (np.float32(y.factor) * pos_freqs)
    keep = 1.0 - np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0.0, 1.0).astype(np.float32)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


@jax.jit
def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, heads, hd]; rotate-half convention (as HF) over the first rd dims
    (rd = cos.shape[-1]); the rest pass through."""
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    out = x_rot * cos + rotated * sin
    return out if rd == x.shape[-1] else jnp.concatenate([out, x_pass], axis=-1)


