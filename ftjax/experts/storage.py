"""Weight formats: the one place that knows how a matrix is stored, converted, sliced
into the device expert cache and handed to the kernels.

Two things live here.

1. **Formats** (`FORMATS`, a table in the spirit of llama.cpp's type traits). A format
   says how one matrix is held in memory: its storage dtype, and how to turn it into
   float32 on the device (`to_f32`) or in numpy (`to_f32_numpy`). Today:

       name       storage   bytes/weight   note
       float32    float32   4              as read
       bfloat16   uint16    2              bf16 bit pattern; XLA CPU converts whole
                                           buffers when it sees bf16, so we keep the
                                           bits and `bitcast_convert_type` at use
       q8_0       uint8     34/32 = 1.06   GGUF Q8_0 blocks: 32 weights share an f16
                                           scale d, w = d * int8 (load(expert_dtype="int8"))
       q4_0       uint8     18/32 = 0.56   GGUF Q4_0 blocks: w = d * (nibble - 8)
                                           (load(expert_dtype="int4"))
       q4_k       uint8     144/256 = 0.56 GGUF Q4_K super-blocks: 8 sub-blocks of 32,
                                           w = d * sc_j * nibble - dmin * m_j
                                           (load(expert_dtype="q4_k"))

   The block formats keep GGUF's bytes exactly: a matrix [rows, n] is stored as uint8
   [rows, n/block * block_bytes], each row a run of blocks, so quantising at load and
   reading a .gguf file's Q8_0 / Q4_0 / Q4_K tensors give the same pool, and the host
   kernels (host_kernels/kernels.h) read any of them in place. Group size 32 with f16
   scales is GGUF's choice: an f16 scale costs what a bf16 one does and keeps 3 more
   mantissa bits. Q8_0 / Q4_0 quantisation is the `gguf` package's (the reference
   quantiser llama.cpp's Python tools use), so such a pool is bit-identical to
   llama.cpp's Q8_0 / Q4_0 of the same weights. The gguf package only dequantises Q4_K,
   so `quantise_q4_k` here is llama.cpp's reference quantiser (quantize_row_q4_K_ref)
   in vectorised numpy; `dequantise` stays the gguf package's. A block format's storage
   dtype (uint8) does not name it: the pool carries its format name, and code that
   decodes weights is given the format.

   Q4_K, the byte layout of one 144-byte super-block of 256 weights (GGUF's block_q4_K):

       bytes 0-1    d      f16, scale of the sub-block scales
       bytes 2-3    dmin   f16, scale of the sub-block mins
       bytes 4-15   12 bytes: eight 6-bit scales sc_j and eight 6-bit mins m_j, packed
                    (j < 4: sc_j = s[j] & 63, m_j = s[j+4] & 63; j >= 4: the low 4 bits
                    in s[j+4] (sc low nibble, m high nibble), the high 2 bits in the top
                    bits of s[j-4] (sc) and s[j] (m))
       bytes 16-143 128 bytes of nibbles: byte 32c + i holds weight 64c + i (low nibble,
                    sub-block 2c) and weight 64c + 32 + i (high nibble, sub-block 2c + 1)

   Every block format meets activations quantised to int8 per 32 values (`act_q8`): a
   Q4_K sub-block of 32 is then one integer dot and one integer sum,
   d*sc_j*d_x*sum(q*q_x) - dmin*m_j*d_x*sum(q_x), which is how the host kernel computes it.

2. **Expert parts.** A routed expert is the pytree `{"gate_up": [2F, D], "down": [D, F]}`
   (the Hugging Face fused layout: gate_up rows 0..F-1 gate, F..2F-1 up). The host pool
   is the same pytree with leading [Lm, E], the device cache with leading [slots], a
   streamed layer block with leading [E]. `expert_parts`, `empty_cache`, `take_expert`
   and `put_expert` are the only functions that build or slice those pytrees, so no
   other module spells the parts out.

Letters: Lm MoE layers, E experts, D model dim, F expert FFN dim, S slots.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

EXPERT_PARTS = ("gate_up", "down")


# ---- formats -------------------------------------------------------------------------

def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit pattern (uint16), round to nearest even; NaN stays NaN."""
    a = np.asarray(a, dtype=np.float32)
    bits = np.ascontiguousarray(a).reshape(a.shape).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit pattern (uint16) -> float32, exact."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _bf16_to_f32(w: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(w, jnp.bfloat16).astype(jnp.float32)


QUANT_BLOCK = 32  # weights per block of Q8_0 / Q4_0, per sub-block of Q4_K, per activation block
Q4_K_BLOCK, Q4_K_BYTES = 256, 144  # weights and bytes of one Q4_K super-block


def _block_scales(blocks: jax.Array) -> jax.Array:
    """blocks [..., nb, block_bytes] uint8 -> the f16 scale d of each block [..., nb, 1] f32."""
    return jax.lax.bitcast_convert_type(blocks[..., :2], jnp.float16).astype(jnp.float32)[..., None]


def _q8_0_to_f32(w: jax.Array) -> jax.Array:
    """[..., rows, nb*34] uint8 -> [..., rows, nb*32] float32 (device, XLA)."""
    blocks = w.reshape(*w.shape[:-1], -1, 34)
    q = jax.lax.bitcast_convert_type(blocks[..., 2:], jnp.int8).astype(jnp.float32)  # [..., nb, 32]
    return (q * _block_scales(blocks)).reshape(*w.shape[:-1], -1)


def _q4_0_to_f32(w: jax.Array) -> jax.Array:
    """[..., rows, nb*18] uint8 -> [..., rows, nb*32] float32 (device, XLA)."""
    blocks = w.reshape(*w.shape[:-1], -1, 18)
    qs = blocks[..., 2:]  # [..., nb, 16]
    q = jnp.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(jnp.float32) - 8.0  # [..., nb, 32]
    return (q * _block_scales(blocks)).reshape(*w.shape[:-1], -1)


def _q4_k_scales_mins(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The 12 packed scale bytes [..., 12] uint8 -> sc, m [..., 8] (6-bit values, XLA)."""
    lo, hi, low4 = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([lo & 0x3F, (low4 & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    m = jnp.concatenate([hi & 0x3F, (low4 >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return sc, m


def _q4_k_to_f32(w: jax.Array) -> jax.Array:
    """[..., rows, nb*144] uint8 -> [..., rows, nb*256] float32 (device, XLA); the same
    float32 operations as gguf's dequantiser: (d * sc) * q - (dmin * m)."""
    blocks = w.reshape(*w.shape[:-1], -1, Q4_K_BYTES)
    d = _block_scales(blocks)  # [..., nb, 1]
    dmin = jax.lax.bitcast_convert_type(blocks[..., 2:4], jnp.float16).astype(jnp.float32)[..., None]
    sc, m = _q4_k_scales_mins(blocks[..., 4:16])  # [..., nb, 8]
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 1, QUANT_BLOCK)  # [..., nb, 4, 1, 32]
    q = jnp.concatenate([qs & 0xF, qs >> 4], axis=-2).reshape(*blocks.shape[:-1], 8, QUANT_BLOCK)  # [..., nb, 8, 32]
    scale = (d * sc.astype(jnp.float32))[..., None]  # [..., nb, 8, 1]
    offset = (dmin * m.astype(jnp.float32))[..., None]
    return (scale * q.astype(jnp.float32) - offset).reshape(*w.shape[:-1], -1)


def _nearest_int(a: np.ndarray) -> np.ndarray:
    """llama.cpp's nearest_int: round half to even, as int32."""
    return np.rint(a).astype(np.int32)


def _seq_sum(a: np.ndarray) -> np.ndarray:
    """[n, G] -> [G]: the sum over the first axis in order, in float32, as C's `s += a[i]`
    loop adds (llama.cpp's choice between candidate fits can hinge on the last bit)."""
    s = a[0].copy()
    for row in a[1:]:
        s += row
    return s


def _qkx2_quants(x: np.ndarray, weights: np.ndarray, nmax: int = 15, rmin: float = -1.0, rdelta: float = 0.1,
                 nstep: int = 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's make_qkx2_quants (squared error) over G groups at once, group-minor:
    x, weights [n, G] float32 -> (scale [G], the_min [G] (>= 0: x ~ scale * L - the_min),
    L [n, G] float32 levels). A weighted least-squares fit of (scale, min) to the levels
    of nstep + 1 candidate inverse scales; a better fit moves the origin of the next ones."""
    f32 = np.float32
    hi = x.max(axis=0)  # [G]
    low = np.minimum(x.min(axis=0), f32(0))
    flat = hi == low  # constant groups (all zero): levels 0, scale 0
    sum_w, sum_x = _seq_sum(weights), _seq_sum(weights * x)

    def levels(iscale, origin, out):  # clip(nearest_int(iscale * (x - origin)), 0, nmax), in float
        np.subtract(x, origin, out=out)
        out *= iscale
        np.rint(out, out=out)
        return np.clip(out, 0, nmax, out=out)

    def error(scale, origin, lv, tmp):  # sum_i w * (scale * l + origin - x)^2, in C's order
        np.multiply(scale, lv, out=tmp)
        tmp += origin
        tmp -= x
        tmp *= tmp
        tmp *= weights
        return _seq_sum(tmp)

    lv, tmp = np.empty_like(x), np.empty_like(x)
    level_iscale = f32(nmax) / np.where(flat, f32(1), hi - low)  # the levels kept: this scale ...
    level_origin = low  # ... about this origin
    scale = f32(1) / level_iscale
    best = error(scale, low, levels(level_iscale, low, lv), tmp)
    for step in range(nstep + 1):
        iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / np.where(flat, f32(1), hi - low)
        levels(iscale, low, lv)
        np.multiply(weights, lv, out=tmp)  # w * l
        sum_l, sum_xl = _seq_sum(tmp), _seq_sum(tmp * x)
        tmp *= lv
        sum_l2 = _seq_sum(tmp)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        det = np.where(ok, det, f32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        clamp = this_min > 0
        this_min = np.where(clamp, f32(0), this_min)
        this_scale = np.where(clamp, sum_xl / np.where(ok, sum_l2, f32(1)), this_scale)
        err = error(this_scale, this_min, lv, tmp)
        better = ok & (err < best)
        level_iscale = np.where(better, iscale, level_iscale)
        level_origin = np.where(better, low, level_origin)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        low = np.where(better, this_min, low)
    L = np.where(flat, f32(0), levels(level_iscale, level_origin, lv))
    return np.where(flat, f32(0), scale), -low, L


Q4_K_CHUNK = 1 << 14  # super-blocks quantised at once (4M weights: temporaries of 16 MiB)


def quantise_q4_k(a: np.ndarray) -> np.ndarray:
    """float32 [..., n] (n % 256 == 0) -> GGUF Q4_K bytes uint8 [..., n/256 * 144]: llama.cpp's
    quantize_row_q4_K_ref in vectorised numpy, the same float32 operations in the same
    order, so the same bytes (checked against libggml-base's quantize_row_q4_K_ref on
    27k super-blocks: Gaussian, heavy-tailed, all-positive, all-negative, constant and
    tied values; ~3.5M weights/s on one core). Per sub-block of 32 the
    (av_x + |x|)-weighted best (scale, min) of `_qkx2_quants`; per super-block the scales
    and mins quantised to 6 bits against d = max scale / 63 and dmin = max min / 63 (f16);
    then every weight requantised to the nibble nearest (x + dmin*m_j) / (d*sc_j)."""
    a = np.asarray(a, np.float32)
    if a.shape[-1] % Q4_K_BLOCK:
        raise ValueError(f"q4_k needs rows of a multiple of {Q4_K_BLOCK} weights, got {a.shape[-1]}")
    x = a.reshape(-1, Q4_K_BLOCK)  # [N, 256] super-blocks
    out = np.empty((x.shape[0], Q4_K_BYTES), np.uint8)  # [N, 144]
    for c in range(0, x.shape[0], Q4_K_CHUNK):
        out[c:c + Q4_K_CHUNK] = _quantise_q4_k_blocks(x[c:c + Q4_K_CHUNK])
    return out.reshape(*a.shape[:-1], -1)


def _quantise_q4_k_blocks(x: np.ndarray) -> np.ndarray:
    """[N, 256] float32 -> [N, 144] uint8 (see `quantise_q4_k`)."""
    f32 = np.float32
    N = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(N * 8, QUANT_BLOCK).T)  # [32, N*8]: sub-blocks, group-minor
    av_x = np.sqrt(_seq_sum(np.square(sub)) / f32(QUANT_BLOCK))  # [N*8]
    scales, mins, L = _qkx2_quants(sub, av_x + np.abs(sub))
    scales, mins = scales.reshape(N, 8), mins.reshape(N, 8)
    L = L.T.reshape(N, 8, QUANT_BLOCK)  # the fit's levels (kept where a quantised scale is 0)
    max_scale = np.maximum(scales.max(axis=-1), f32(0))  # [N]
    max_min = np.maximum(mins.max(axis=-1), f32(0))
    inv_scale = np.where(max_scale > 0, f32(63) / np.where(max_scale > 0, max_scale, f32(1)), f32(0))
    inv_min = np.where(max_min > 0, f32(63) / np.where(max_min > 0, max_min, f32(1)), f32(0))
    # C's uint8 casts: a negative level wraps, then min(63, .) clamps it
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)  # [N, 8]
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    packed = np.concatenate([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                             (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)], axis=-1)  # [N, 12]
    d16 = (max_scale / f32(63)).astype(np.float16)
    dmin16 = (max_min / f32(63)).astype(np.float16)
    d = d16.astype(f32)[:, None] * ls.astype(f32)  # [N, 8]
    dm = dmin16.astype(f32)[:, None] * lm.astype(f32)
    live = d != 0  # a zero scale keeps the levels of the fit, as llama.cpp does
    xs = x.reshape(N, 8, QUANT_BLOCK)
    requant = np.clip(np.rint((xs + dm[..., None]) / np.where(live, d, f32(1))[..., None]), 0, 15)
    L = np.where(live[..., None], requant, L).astype(np.uint8)  # [N, 8, 32]
    qs = (L[:, 0::2] | (L[:, 1::2] << 4)).reshape(N, -1)  # [N, 128]: sub-block 2c low nibbles, 2c+1 high
    return np.concatenate([d16.view(np.uint8).reshape(N, 2), dmin16.view(np.uint8).reshape(N, 2), packed, qs],
                          axis=-1)


def quantise_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy twin of the host kernels' activation quantiser (host_kernels/kernels.h ActQ8):
    x [..., n] (n % 32 == 0) -> q [..., n] int8, d [..., n/32] float32, per 32 values
    d = max|x| / 127 and q = round-half-even(x * (1 / d)), all in float32 (the kernels'
    blocks also carry d * sum(q), which Q4_K's min terms use)."""
    x = np.asarray(x, np.float32)
    b = x.reshape(*x.shape[:-1], -1, QUANT_BLOCK)
    d = np.abs(b).max(axis=-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    return np.rint(b * inv[..., None]).astype(np.int8).reshape(x.shape), d


def act_q8_numpy(x: np.ndarray) -> np.ndarray:
    """x as a block-format expert sees it: quantised per 32 and dequantised (float32)."""
    q, d = quantise_activations(x)
    return (q.reshape(*q.shape[:-1], -1, QUANT_BLOCK) * d[..., None]).reshape(q.shape).astype(np.float32)


def act_q8(x: jax.Array) -> jax.Array:
    """XLA twin of `act_q8_numpy` (the device FFN of a block format): [..., n] f32."""
    b = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, QUANT_BLOCK)
    d = jnp.max(jnp.abs(b), axis=-1, keepdims=True) / jnp.float32(127)
    inv = jnp.where(d != 0, jnp.float32(1) / jnp.where(d != 0, d, 1), 0)
    return (jnp.round(b * inv) * d).reshape(x.shape)


def _gguf_codec(name: str, block: int):
    """(quantise, dequantise) numpy functions of a GGUF block type of `block` weights,
    from the gguf package (imported on first use)."""

    def quantise(a: np.ndarray) -> np.ndarray:
        from gguf import GGMLQuantizationType, quants

        a = np.asarray(a, np.float32)
        if a.shape[-1] % block:
            raise ValueError(f"{name} needs rows of a multiple of {block} weights, got {a.shape[-1]}")
        return quants.quantize(a, GGMLQuantizationType[name.upper()])

    def dequantise(a: np.ndarray) -> np.ndarray:
        from gguf import GGMLQuantizationType, quants

        return quants.dequantize(np.asarray(a, np.uint8), GGMLQuantizationType[name.upper()]).astype(np.float32)

    return quantise, dequantise


@dataclasses.dataclass(frozen=True)
class Format:
    """How one matrix is stored (see the module table)."""

    name: str
    storage: np.dtype  # numpy dtype of the stored array
    bytes_per_weight: float
    to_f32: Callable[[jax.Array], jax.Array]  # device: storage -> float32
    to_f32_numpy: Callable[[np.ndarray], np.ndarray]
    from_f32_numpy: Callable[[np.ndarray], np.ndarray]  # float32 -> storage (rounds)
    block: int = 1  # weights per block (a row is whole blocks)
    block_bytes: int = 0  # bytes per block (0: plain, storage itemsize per weight)
    # what the activations meeting these weights go through (block formats: the int8
    # quantisation of the host kernels, so every path computes the same products)
    act: Callable[[jax.Array], jax.Array] = staticmethod(lambda x: x)

    def row_bytes(self, n: int) -> int:
        """Bytes of one stored row of n weights."""
        if self.block == 1:
            return n * self.storage.itemsize
        if n % self.block:
            raise ValueError(f"{self.name} rows must hold a multiple of {self.block} weights, got {n}")
        return n // self.block * self.block_bytes

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Logical matrix shape [..., rows, n] -> the stored array's shape."""
        return (*shape[:-1], self.row_bytes(shape[-1]) // self.storage.itemsize)

    def row_len(self, stored_cols: int) -> int:
        """Weights per row from the stored array's last dimension."""
        return stored_cols if self.block == 1 else stored_cols // self.block_bytes * self.block


def _block_format(name: str, block_bytes: int, to_f32, block: int = QUANT_BLOCK, quantise=None) -> Format:
    """A GGUF block format: gguf's dequantiser, and its quantiser unless one is given."""
    gguf_quantise, dequantise = _gguf_codec(name, block)
    return Format(name, np.dtype(np.uint8), block_bytes / block, to_f32, dequantise, quantise or gguf_quantise,
                  block, block_bytes, act_q8)


FORMATS: dict[str, Format] = {
    "float32": Format("float32", np.dtype(np.float32), 4, lambda w: w.astype(jnp.float32),
                      lambda a: np.asarray(a, np.float32), lambda a: np.asarray(a, np.float32)),
    "bfloat16": Format("bfloat16", np.dtype(np.uint16), 2, _bf16_to_f32, bf16_bits_to_f32, to_bf16_bits),
    "q8_0": _block_format("q8_0", 34, _q8_0_to_f32),
    "q4_0": _block_format("q4_0", 18, _q4_0_to_f32),
    "q4_k": _block_format("q4_k", Q4_K_BYTES, _q4_k_to_f32, Q4_K_BLOCK, quantise_q4_k),
}
BLOCK_FORMATS = tuple(name for name, f in FORMATS.items() if f.block > 1)
_BY_STORAGE = {f.storage: f for f in FORMATS.values() if f.block == 1}


def format_of(a) -> Format:
    """The format of a plain (unblocked) array, from its dtype (uint16 = bf16 bits);
    block formats are named by their pool, never guessed from uint8."""
    dtype = np.dtype(a.dtype)
    if dtype not in _BY_STORAGE:
        raise TypeError(f"no plain weight format is stored as {dtype} (formats: {', '.join(FORMATS)})")
    return _BY_STORAGE[dtype]


def as_f32(w: jax.Array) -> jax.Array:
    """Any stored matrix -> float32 on the device (other float dtypes are upcast)."""
    if w.dtype == jnp.uint16:
        return _bf16_to_f32(w)
    return w.astype(jnp.float32)


# What `load(expert_dtype=...)` accepts for the block formats, besides their names.
QUANTISED_ALIASES = {"int8": "q8_0", "int4": "q4_0"}


def canonical_dtype(dtype) -> str:
    """A format name of `FORMATS`: 'bf16' | 'bfloat16' | np.uint16 | ml_dtypes.bfloat16 ->
    'bfloat16'; f32 alike; the block formats ('q8_0', 'q4_0', 'q4_k') as named (a dtype
    such as int8 is not a format: `QUANTISED_ALIASES` are resolved where users name an
    expert dtype)."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    aliases = {"bf16": "bfloat16", "bfloat16": "bfloat16", "uint16": "bfloat16",
               "f32": "float32", "fp32": "float32", "float32": "float32", **{f: f for f in BLOCK_FORMATS}}
    if name not in aliases:
        raise ValueError(f"unsupported expert format {dtype!r} (formats: {', '.join(FORMATS)})")
    return aliases[name]


# ---- expert parts ---------------------------------------------------------------------

def expert_part_shapes(d_model: int, d_ff: int) -> dict[str, tuple[int, ...]]:
    """Logical shape of each part of ONE expert: gate_up [2F, D], down [D, F] (a block
    format stores [2F, bytes(D)], [D, bytes(F)]: `Format.stored_shape`)."""
    return {"gate_up": (2 * d_ff, d_model), "down": (d_model, d_ff)}


def expert_parts(pool) -> dict[str, np.ndarray]:
    """The host pool as the parts pytree {"gate_up": [Lm, E, 2F, D], "down": [Lm, E, D, F]}."""
    return {name: getattr(pool, name) for name in EXPERT_PARTS}


def expert_bytes(parts: dict) -> int:
    """Bytes of one expert of a parts pytree with two leading axes (pool) or one (cache)."""
    return sum(int(np.prod(a.shape[-2:])) * np.dtype(a.dtype).itemsize for a in parts.values())


def empty_cache(pool_parts: dict, slots: int) -> dict[str, np.ndarray]:
    """Zeroed device-cache pytree [slots, ...] in the pool's storage (numpy, host side)."""
    return {k: np.zeros((slots, *a.shape[2:]), a.dtype) for k, a in pool_parts.items()}


def take_expert(parts: dict, layer, e) -> dict[str, jax.Array]:
    """Expert (layer, e) of a pool pytree [Lm, E, ...] -> [1, ...] per part (traced ids)."""
    return {k: jax.lax.dynamic_slice_in_dim(a[layer], e, 1) for k, a in parts.items()}


def put_expert(cache: dict, expert: dict, slot) -> dict[str, jax.Array]:
    """cache [slots, ...] with slot <- expert [1, ...] (in place when the cache is donated)."""
    return {k: jax.lax.dynamic_update_index_in_dim(cache[k], expert[k], slot, 0) for k in cache}


def flat_rows(parts: dict) -> dict[str, jax.Array]:
    """[Lm, E, ...] -> [Lm*E, ...] per part: a free reshape, so a kernel can index the whole
    pool instead of a layer's slice (which XLA would copy)."""
    return {k: a.reshape(-1, *a.shape[2:]) for k, a in parts.items()}
