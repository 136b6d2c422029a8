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
       q6_k       uint8     210/256 = 0.82 GGUF Q6_K super-blocks: 16 sub-blocks of 16,
                                           w = d * scale_j * (q - 32), q 6 bits
       mxfp4      uint8     17/32 = 0.53   GGUF MXFP4 (OCP microscaling): 32 e2m1 values
                                           share an e8m0 exponent, w = 2^(e-127) * e2m1
       fp8_e4m3   uint8     132/128 = 1.03 DeepSeek-V3's FP8: rows of 128-weight blocks
                                           {f32 scale of the 128 x 128 tile, 128 e4m3fn}
       q4_k_or_q6_k uint8   212/256 = 0.83 a Q4_K or a Q6_K super-block behind a tag byte
                                           (GGUF Q4_K_M's ffn_down_exps, see below)

   Relative Frobenius error of one expert FFN's output against the bf16 experts it was
   quantised from (random Gaussian experts, D = F = 256, weights and activations as each
   format computes them; tests/test_quant.py): q8_0 1.5%, q4_0 15%, q4_k 12.6%, q6_k 3.3%,
   mxfp4 20%, fp8_e4m3 4.6% (float activations: the weights' 3 mantissa bits alone).

   The block formats keep GGUF's bytes exactly: a matrix [rows, n] is stored as uint8
   [rows, n/block * block_bytes], each row a run of blocks, so quantising at load and
   reading a .gguf file's Q8_0 / Q4_0 / Q4_K / Q6_K / MXFP4 tensors give the same pool, and the host
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

   Q6_K, one 210-byte super-block of 256 weights (GGUF's block_q6_K):

       bytes 0-127   ql: low 4 bits of the 6-bit levels q (0..63)
       bytes 128-191 qh: high 2 bits
       bytes 192-207 16 int8 scales, one per sub-block of 16 consecutive weights
       bytes 208-209 d    f16
       weight 128h + 32k + l (h < 2, k < 4, l < 32): low bits in ql[64h + 32(k & 1) + l]
       (low nibble for k < 2, high nibble for k >= 2), high bits (qh[32h + l] >> 2k) & 3

   The gguf package only dequantises Q6_K; `quantise_q6_k` is llama.cpp's
   quantize_row_q6_K_ref in vectorised numpy (the same bytes: checked against libggml-base).

   MXFP4, one 17-byte block of 32 weights (GGUF's block_mxfp4, the OCP MX format of
   gpt-oss's `*_blocks` / `*_scales` tensors): byte 0 the e8m0 exponent e (scale 2^(e-127)),
   bytes 1-16 the e2m1 nibbles as Q4_0 lays them out (weight i < 16 the low nibble of byte
   1 + i, weight i >= 16 the high nibble of byte 1 + i - 16). e2m1 values doubled are the
   integers {0, +-1, +-2, +-3, +-4, +-6, +-8, +-12}, so with a scale of 2^(e-128) a block is
   an int8 dot (llama.cpp's MXFP4 path). Quantiser and dequantiser: the gguf package's.
   `mxfp4_blocks` relays gpt-oss's tensors into these rows (a nibble permutation); loading
   them as stored awaits a supported family that ships them.

   fp8_e4m3, one 132-byte block of 128 weights (ftjax's layout, not a GGUF type):

       bytes 0-3     f32 scale: the weight_scale_inv of the 128 x 128 tile the block lies in
       bytes 4-131   128 float8_e4m3fn values as stored, w = e4m3 * scale

   DeepSeek-V3's checkpoints keep one scale per 128 x 128 tile; a row copies its tile's
   scale into each of its blocks (`fp8_blocks`: a relayout of the scales, 3% more bytes,
   so a row is self-contained like a GGUF row and the kernels stream one row at a time).
   `quantise_fp8_e4m3` is DeepSeek's scheme: scale = tile amax / 448, q = e4m3(w / scale).
   FP8 weights meet float32 activations (its `act` is the identity): e4m3 levels are not
   8-bit integers, and the host kernel converts e4m3 to float in registers (exactly,
   through f16) at no cost to a memory-bound row stream.

   Every other block format meets activations quantised to int8 (`Format.act_block`,
   `act_q8`): per 32 values for Q8_0 / Q4_0 / MXFP4, per 256 (one scale d_x per super-block,
   llama.cpp's Q8_K) for Q4_K / Q6_K. A Q4_K super-block is then two integer sums,
   d*d_x*sum_j(sc_j*sum(q*q_x)) - dmin*d_x*sum_j(m_j*sum(q_x)), one conversion each, which
   is how the host kernel computes it (per-32 activation scales cost a conversion and an
   FMA per sub-block: 0.6x llama.cpp's Q4_K speed on Zen 4). The price is precision: a
   scale per 256 values rounds the small ones of a block more coarsely.

   A pool's two expert parts may have different formats (`pool_format`: 'q4_k/q6_k' is a
   GGUF file's gate / up in Q4_K and down in Q6_K; `part_formats` splits the name).
   The layers of one part share its format. llama.cpp's Q4_K_M gives ffn_down_exps Q6_K on
   some layers and Q4_K on the others, and neither format holds the other's blocks (Q4_K's
   per-sub-block min is off Q6_K's grid; only float32 holds both exactly), so such a part
   is stored as `q4_k_or_q6_k`: each 256-weight super-block as stored behind a tag,

       byte 0        tag: 4 (Q4_K) or 6 (Q6_K)
       byte 1        0
       bytes 2-211   a Q6_K block, or a Q4_K block (bytes 2-145) and 66 zero bytes

   (212 bytes / 256 = 0.83 a weight: a Q4_K layer pays Q6_K's width, +47%; all of a layer's
   blocks share a tag, so the kernels' branch per block is always predicted; the device
   decodes both ways and selects). `tagged_k_blocks` builds it from GGUF bytes.

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
import functools
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


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16 (ties to even), as float32 (numpy twin
    of `rounded_to_bf16`)."""
    return bf16_bits_to_f32(to_bf16_bits(np.asarray(x, np.float32)))


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit pattern (uint16) -> float32, exact."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _bf16_to_f32(w: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(w, jnp.bfloat16).astype(jnp.float32)


QUANT_BLOCK = 32  # weights per block of Q8_0 / Q4_0 / MXFP4, per sub-block of Q4_K, per activation block
K_ACT_BLOCK = 256  # values per activation block meeting the K super-block types (ActQ8K)
Q4_K_BLOCK, Q4_K_BYTES = 256, 144  # weights and bytes of one Q4_K super-block
Q6_K_BLOCK, Q6_K_BYTES = 256, 210  # weights and bytes of one Q6_K super-block
Q46_K_BYTES = 212  # bytes of one tagged Q4_K-or-Q6_K super-block (q4_k_or_q6_k)
Q46_K_TAGS = {"q4_k": 4, "q6_k": 6}  # its tag byte
MXFP4_BYTES = 17  # bytes of one MXFP4 block of 32 weights
FP8_BLOCK, FP8_BYTES = 128, 132  # weights and bytes of one fp8_e4m3 row block (f32 scale + 128 bytes)
FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


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


def _q6_k_to_f32(w: jax.Array) -> jax.Array:
    """[..., rows, nb*210] uint8 -> [..., rows, nb*256] float32 (device, XLA); gguf's float32
    operations: (d * scale_j) * (q - 32)."""
    blocks = w.reshape(*w.shape[:-1], -1, Q6_K_BYTES)
    lead = blocks.shape[:-1]
    ql = blocks[..., :128].reshape(*lead, 2, 1, 64)  # [..., nb, half, 1, 64]
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)  # [..., nb, half, 1, 32]
    sc = jax.lax.bitcast_convert_type(blocks[..., 192:208], jnp.int8).astype(jnp.float32)  # [..., nb, 16]
    d = jax.lax.bitcast_convert_type(blocks[..., 208:210], jnp.float16).astype(jnp.float32)  # [..., nb]
    low = jnp.concatenate([ql & 0xF, ql >> 4], axis=-2).reshape(*lead, 2, 4, 32)  # quarter k of a half
    high = jnp.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-2)  # [..., nb, half, 4, 32]
    q = (low | (high << 4)).astype(jnp.float32) - 32.0
    scale = (d[..., None] * sc).reshape(*lead, 16, 1)  # [..., nb, 16, 1]
    return (scale * q.reshape(*lead, 16, 16)).reshape(*w.shape[:-1], -1)


def _q4_k_or_q6_k_to_f32(w: jax.Array) -> jax.Array:
    """[..., rows, nb*212] uint8 -> [..., rows, nb*256] float32 (device, XLA): each block
    decoded both ways and the one its tag names kept (a layer's blocks share a tag)."""
    blocks = w.reshape(*w.shape[:-1], -1, Q46_K_BYTES)
    q4 = _q4_k_to_f32(blocks[..., 2:2 + Q4_K_BYTES])  # [..., nb, 256]
    q6 = _q6_k_to_f32(blocks[..., 2:])
    return jnp.where(blocks[..., :1] == Q46_K_TAGS["q6_k"], q6, q4).reshape(*w.shape[:-1], -1)


MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1 nibble -> 2 x value


def _e8m0_half(e: jax.Array) -> jax.Array:
    """e8m0 exponent bytes -> 2^(e - 128) float32 (half the block scale: the nibble values
    are doubled), ggml's e8m0_to_fp32_half bit for bit (e < 2: f32 subnormals)."""
    e = e.astype(jnp.uint32)
    bits = jnp.where(e < 2, jnp.uint32(0x00200000) << e, (e - 1) << 23)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _mxfp4_to_f32(w: jax.Array) -> jax.Array:
    """[..., rows, nb*17] uint8 -> [..., rows, nb*32] float32 (device, XLA)."""
    blocks = w.reshape(*w.shape[:-1], -1, MXFP4_BYTES)
    qs = blocks[..., 1:]  # [..., nb, 16]
    nib = jnp.concatenate([qs & 0xF, qs >> 4], axis=-1)  # [..., nb, 32]
    v = jnp.asarray(MXFP4_VALUES, jnp.float32)[nib]
    return (v * _e8m0_half(blocks[..., 0])[..., None]).reshape(*w.shape[:-1], -1)


def _fp8_e4m3_to_f32(w: jax.Array) -> jax.Array:
    """[..., rows, nb*132] uint8 -> [..., rows, nb*128] float32 (device, XLA): e4m3 * scale."""
    blocks = w.reshape(*w.shape[:-1], -1, FP8_BYTES)
    scale = jax.lax.bitcast_convert_type(blocks[..., :4], jnp.float32)[..., None]  # [..., nb, 1]
    q = jax.lax.bitcast_convert_type(blocks[..., 4:], jnp.float8_e4m3fn).astype(jnp.float32)  # [..., nb, 128]
    return (q * scale).reshape(*w.shape[:-1], -1)


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


def _by_super_blocks(a: np.ndarray, name: str, block: int, block_bytes: int, quantise_blocks) -> np.ndarray:
    """float32 [..., n] (n % block == 0) -> uint8 [..., n/block * block_bytes]: rows cut into
    super-blocks, quantised Q4_K_CHUNK at a time by quantise_blocks ([N, block] -> [N, block_bytes])."""
    a = np.asarray(a, np.float32)
    if a.shape[-1] % block:
        raise ValueError(f"{name} needs rows of a multiple of {block} weights, got {a.shape[-1]}")
    x = a.reshape(-1, block)  # [N, block] super-blocks
    out = np.empty((x.shape[0], block_bytes), np.uint8)
    for c in range(0, x.shape[0], Q4_K_CHUNK):
        out[c:c + Q4_K_CHUNK] = quantise_blocks(x[c:c + Q4_K_CHUNK])
    return out.reshape(*a.shape[:-1], -1)


def quantise_q4_k(a: np.ndarray) -> np.ndarray:
    """float32 [..., n] (n % 256 == 0) -> GGUF Q4_K bytes uint8 [..., n/256 * 144]: llama.cpp's
    quantize_row_q4_K_ref in vectorised numpy, the same float32 operations in the same
    order, so the same bytes (checked against libggml-base's quantize_row_q4_K_ref on
    27k super-blocks: Gaussian, heavy-tailed, all-positive, all-negative, constant and
    tied values; ~3.5M weights/s on one core). Per sub-block of 32 the
    (av_x + |x|)-weighted best (scale, min) of `_qkx2_quants`; per super-block the scales
    and mins quantised to 6 bits against d = max scale / 63 and dmin = max min / 63 (f16);
    then every weight requantised to the nibble nearest (x + dmin*m_j) / (d*sc_j)."""
    return _by_super_blocks(a, "q4_k", Q4_K_BLOCK, Q4_K_BYTES, _quantise_q4_k_blocks)


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


def _make_qx_quants(x: np.ndarray, nmax: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's make_qx_quants(n, nmax, x, L, rmse_type=1, NULL) over G groups at once,
    group-minor: x [n, G] float32 -> (scale [G], L [n, G] int levels in 0..2*nmax-1).
    Levels of the inverse scale -nmax / max (max: the value of largest |x|), then 18 more
    candidates -(nmax + 0.1*is) / max, is = -9..9, each kept if its x^2-weighted
    least-squares fit is better (sumlx^2 / suml2 larger), all in float32 in C's order."""
    f32 = np.float32
    idx = np.abs(x).argmax(axis=0)  # the first of equal |x|, as C's `>` keeps
    mx = x[idx, np.arange(x.shape[1])]
    live = np.abs(mx) >= f32(1e-15)  # GROUP_MAX_EPS
    mx = np.where(live, mx, f32(1))
    w = x * x

    def fit(iscale):
        lv = np.clip(np.rint(iscale * x), -nmax, nmax - 1)
        wl = w * x * lv  # (w * x) * l, as C evaluates w*x[i]*l
        return lv, _seq_sum(wl), _seq_sum(w * lv * lv)

    lv, sumlx, suml2 = fit(f32(-nmax) / mx)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, f32(1)), f32(0))
    best = scale * sumlx
    L = lv
    for i in range(-9, 10):
        if i == 0:
            continue
        lv, sumlx, suml2 = fit(-(f32(nmax) + f32(0.1) * f32(i)) / mx)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = np.where(better, lv, L)
        scale = np.where(better, sumlx / np.where(better, suml2, f32(1)), scale)
        best = np.where(better, scale * sumlx, best)
    return np.where(live, scale, f32(0)), np.where(live, L + nmax, 0).astype(np.int32)


def quantise_q6_k(a: np.ndarray) -> np.ndarray:
    """float32 [..., n] (n % 256 == 0) -> GGUF Q6_K bytes uint8 [..., n/256 * 210]: llama.cpp's
    quantize_row_q6_K_ref in vectorised numpy (the gguf package only dequantises Q6_K), the
    same float32 operations in the same order, so the same bytes (checked against
    libggml-base's quantize_row_q6_K_ref, see tests/test_quant.py). Per sub-block of 16 the
    x^2-weighted best scale of `_make_qx_quants` (6-bit levels -32..31); per super-block the
    16 scales quantised to int8 against d = -max_scale / 128 (f16, max_scale the scale of
    largest |.|); then every weight requantised to the level nearest x / (d * scale_j)."""
    return _by_super_blocks(a, "q6_k", Q6_K_BLOCK, Q6_K_BYTES, _quantise_q6_k_blocks)


def _quantise_q6_k_blocks(x: np.ndarray) -> np.ndarray:
    """[N, 256] float32 -> [N, 210] uint8 (see `quantise_q6_k`)."""
    f32 = np.float32
    N = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(N * 16, 16).T)  # [16, N*16]: sub-blocks, group-minor
    scales, L = _make_qx_quants(sub)
    scales = scales.reshape(N, 16)
    L = L.T.reshape(N, 16, 16)  # levels 0..63 of the fit (kept where a quantised scale is 0)
    pick = np.abs(scales).argmax(axis=-1)  # the first of equal |scale|, as C's `>` keeps
    max_scale = scales[np.arange(N), pick]
    live = np.abs(max_scale) >= f32(1e-15)  # GROUP_MAX_EPS: else an all-zero block
    iscale = f32(-128) / np.where(live, max_scale, f32(1))
    d16 = np.where(live, f32(1) / iscale, f32(0)).astype(np.float16)
    sc = np.minimum(127, _nearest_int(iscale[:, None] * scales)).astype(np.int8)  # [N, 16]
    d = d16.astype(f32)[:, None] * sc.astype(f32)  # [N, 16]
    nz = d != 0
    requant = np.clip(np.rint(x.reshape(N, 16, 16) / np.where(nz, d, f32(1))[..., None]), -32, 31) + 32
    L = np.where(nz[..., None], requant, L).astype(np.uint8).reshape(N, 2, 4, 32)  # [N, half, quarter, 32]
    ql = np.concatenate([L[:, :, 0] & 0xF | (L[:, :, 2] & 0xF) << 4,
                         L[:, :, 1] & 0xF | (L[:, :, 3] & 0xF) << 4], axis=-1).reshape(N, 128)
    qh = (L[:, :, 0] >> 4 | (L[:, :, 1] >> 4) << 2 | (L[:, :, 2] >> 4) << 4 | (L[:, :, 3] >> 4) << 6).reshape(N, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d16.view(np.uint8).reshape(N, 2)], axis=-1)
    out[~live] = 0
    return out


def fp8_blocks(q: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """A DeepSeek-V3 FP8 weight as stored -> fp8_e4m3 rows: q [..., rows, n] float8_e4m3fn (or
    its uint8 bits), scale_inv [..., ceil(rows/128), ceil(n/128)] float32 (w = q * scale_inv
    per 128 x 128 tile) -> uint8 [..., rows, n/128 * 132], each row's 128-weight blocks
    {f32 scale of its tile, the 128 e4m3 bytes as stored}. A relayout (each tile's scale
    copied to its 128 rows), not a dequantisation: the bytes of q are kept."""
    q = np.asarray(q).view(np.uint8)
    rows, n = q.shape[-2:]
    if n % FP8_BLOCK:
        raise ValueError(f"fp8_e4m3 needs rows of a multiple of {FP8_BLOCK} weights, got {n}")
    scale_inv = np.asarray(scale_inv, np.float32)
    want = (*q.shape[:-2], -(-rows // FP8_BLOCK), n // FP8_BLOCK)
    if scale_inv.shape != want:
        raise ValueError(f"scale_inv has shape {list(scale_inv.shape)}, expected {list(want)} for a weight of "
                         f"shape {list(q.shape)} in 128 x 128 tiles")
    per_row = np.repeat(scale_inv, FP8_BLOCK, axis=-2)[..., :rows, :, None]  # [..., rows, nb, 1]
    out = np.empty((*q.shape[:-1], n // FP8_BLOCK, FP8_BYTES), np.uint8)
    out[..., :4] = np.ascontiguousarray(per_row).view(np.uint8)
    out[..., 4:] = q.reshape(*q.shape[:-1], -1, FP8_BLOCK)
    return out.reshape(*q.shape[:-1], -1)


def quantise_fp8_e4m3(a: np.ndarray) -> np.ndarray:
    """float32 [..., rows, n] (n % 128 == 0) -> fp8_e4m3 rows: DeepSeek-V3's scheme, per
    128 x 128 tile (the last one of rows or of a 1-D input partial) scale_inv = amax / 448
    and q = e4m3(w / scale_inv) (ml_dtypes' round to nearest even, saturating at 448 by
    construction); then `fp8_blocks`. An all-zero tile gets scale 0 (q = 0)."""
    import ml_dtypes

    a = np.asarray(a, np.float32)
    if a.shape[-1] % FP8_BLOCK:
        raise ValueError(f"fp8_e4m3 needs rows of a multiple of {FP8_BLOCK} weights, got {a.shape[-1]}")
    m = a[None] if a.ndim == 1 else a
    rows, n = m.shape[-2:]
    pad = -rows % FP8_BLOCK
    tiles = np.pad(np.abs(m), [(0, 0)] * (m.ndim - 2) + [(0, pad), (0, 0)])
    tiles = tiles.reshape(*m.shape[:-2], (rows + pad) // FP8_BLOCK, FP8_BLOCK, n // FP8_BLOCK, FP8_BLOCK)
    scale_inv = tiles.max(axis=(-3, -1)) / np.float32(FP8_E4M3_MAX)  # [..., rows/128, n/128]
    per = np.repeat(np.repeat(scale_inv, FP8_BLOCK, axis=-2)[..., :rows, :], FP8_BLOCK, axis=-1)
    q = np.divide(m, per, out=np.zeros_like(m), where=per != 0).astype(ml_dtypes.float8_e4m3fn)
    out = fp8_blocks(q, scale_inv)
    return out[0] if a.ndim == 1 else out


def tagged_k_blocks(data: np.ndarray, fmt: str) -> np.ndarray:
    """GGUF Q4_K or Q6_K rows as stored, uint8 [..., nb * (144 | 210)] (fmt 'q4_k' | 'q6_k') ->
    q4_k_or_q6_k rows [..., nb * 212]: each block behind its tag byte and a zero byte, a Q4_K
    one followed by 66 zero bytes. The GGUF bytes are kept: nothing is re-encoded."""
    f = FORMATS[fmt]
    b = np.asarray(data, np.uint8).reshape(*np.shape(data)[:-1], -1, f.block_bytes)
    out = np.zeros((*b.shape[:-1], Q46_K_BYTES), np.uint8)
    out[..., 0] = Q46_K_TAGS[fmt]
    out[..., 2:2 + f.block_bytes] = b
    return out.reshape(*b.shape[:-2], -1)


def dequantise_q4_k_or_q6_k(a: np.ndarray) -> np.ndarray:
    """q4_k_or_q6_k rows uint8 [..., nb*212] -> float32 [..., nb*256]: gguf's Q4_K or Q6_K
    dequantiser per block, as its tag says."""
    b = np.asarray(a, np.uint8).reshape(*np.shape(a)[:-1], -1, Q46_K_BYTES)
    with np.errstate(invalid="ignore", over="ignore"):  # the other type's reading of a block: discarded
        q4 = FORMATS["q4_k"].to_f32_numpy(np.ascontiguousarray(b[..., 2:2 + Q4_K_BYTES]))
        q6 = FORMATS["q6_k"].to_f32_numpy(np.ascontiguousarray(b[..., 2:]))
    return np.where(b[..., :1] == Q46_K_TAGS["q6_k"], q6, q4).reshape(*b.shape[:-2], -1)


def mxfp4_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """gpt-oss's MXFP4 tensors as stored -> mxfp4 rows: blocks uint8 [..., n/32, 16] (byte j
    of a group holds element 2j in its low nibble, 2j + 1 in its high nibble), scales uint8
    [..., n/32] (e8m0, bias 127) -> uint8 [..., n/32 * 17], GGUF's block_mxfp4 (scale byte,
    then elements 0..15 in the low nibbles and 16..31 in the high ones). Both hold e2m1 codes
    with the same 16 values and 2^(e - 127) scales: a relayout of the nibbles, lossless. (No
    family ftjax loads ships such tensors yet; this is the conversion a loader would use.)"""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"blocks {list(blocks.shape)} and scales {list(scales.shape)} are not [..., G, 16], [..., G]")
    codes = np.stack([blocks & 0xF, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)  # element order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], packed], axis=-1).reshape(*scales.shape[:-1], -1)


def dequantise_fp8_e4m3(a: np.ndarray) -> np.ndarray:
    """fp8_e4m3 rows uint8 [..., nb*132] -> float32 [..., nb*128] (numpy twin of the XLA one)."""
    import ml_dtypes

    b = np.ascontiguousarray(a, np.uint8).reshape(*np.shape(a)[:-1], -1, FP8_BYTES)
    scale = np.ascontiguousarray(b[..., :4]).view(np.float32)  # [..., nb, 1]
    q = np.ascontiguousarray(b[..., 4:]).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (q * scale).reshape(*b.shape[:-2], -1)


def quantise_activations(x: np.ndarray, block: int = QUANT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """numpy twin of the host kernels' activation quantisers (host_kernels/kernels.h ActQ8,
    block 32; ActQ8K, block 256): x [..., n] (n % block == 0) -> q [..., n] int8,
    d [..., n/block] float32, per block d = max|x| / 127 and q = round-half-even(x * (1 / d)),
    all in float32 (ActQ8K also carries the sums of each 16 q, which the Q4_K mins and
    Q6_K's offset use)."""
    x = np.asarray(x, np.float32)
    b = x.reshape(*x.shape[:-1], -1, block)
    d = np.abs(b).max(axis=-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    return np.rint(b * inv[..., None]).astype(np.int8).reshape(x.shape), d


def act_q8_numpy(x: np.ndarray, block: int = QUANT_BLOCK) -> np.ndarray:
    """x as a block-format expert sees it: quantised per `block` values and dequantised (float32)."""
    q, d = quantise_activations(x, block)
    return (q.reshape(*q.shape[:-1], -1, block) * d[..., None]).reshape(q.shape).astype(np.float32)


def act_q8(x: jax.Array, block: int = QUANT_BLOCK) -> jax.Array:
    """XLA twin of `act_q8_numpy` (the device FFN of a block format): [..., n] f32."""
    b = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, block)
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
    # values per int8 block of the activations meeting these weights (the host kernels'
    # quantiser, kernels.h act_block: 32, 256 for the K super-blocks; 0: float32 as given)
    act_block: int = 0
    # activations rounded to bf16 instead (`on_bf16_tiles`: a prompt on the bf16 tiles)
    act_bf16: bool = False

    def act(self, x: jax.Array) -> jax.Array:
        """The activations these weights meet, as every path computes them (XLA)."""
        if self.act_bf16:
            return rounded_to_bf16(x)
        return act_q8(x, self.act_block) if self.act_block else x

    def act_numpy(self, x: np.ndarray) -> np.ndarray:
        """numpy twin of `act`."""
        if self.act_bf16:
            return round_to_bf16(x)
        return act_q8_numpy(x, self.act_block) if self.act_block else x

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
    """A GGUF block format: gguf's dequantiser, and its quantiser unless one is given;
    activations in int8 blocks of 32, or of 256 (one per super-block) for the K types."""
    gguf_quantise, dequantise = _gguf_codec(name, block)
    return Format(name, np.dtype(np.uint8), block_bytes / block, to_f32, dequantise, quantise or gguf_quantise,
                  block, block_bytes, min(block, K_ACT_BLOCK))


FORMATS: dict[str, Format] = {
    "float32": Format("float32", np.dtype(np.float32), 4, lambda w: w.astype(jnp.float32),
                      lambda a: np.asarray(a, np.float32), lambda a: np.asarray(a, np.float32)),
    "bfloat16": Format("bfloat16", np.dtype(np.uint16), 2, _bf16_to_f32, bf16_bits_to_f32, to_bf16_bits),
    "q8_0": _block_format("q8_0", 34, _q8_0_to_f32),
    "q4_0": _block_format("q4_0", 18, _q4_0_to_f32),
    "q4_k": _block_format("q4_k", Q4_K_BYTES, _q4_k_to_f32, Q4_K_BLOCK, quantise_q4_k),
    "q6_k": _block_format("q6_k", Q6_K_BYTES, _q6_k_to_f32, Q6_K_BLOCK, quantise_q6_k),
    "mxfp4": _block_format("mxfp4", MXFP4_BYTES, _mxfp4_to_f32),
    # Q4_K or Q6_K per super-block behind a tag (a GGUF part whose layers mix the two);
    # quantising from float gives Q6_K blocks
    "q4_k_or_q6_k": Format("q4_k_or_q6_k", np.dtype(np.uint8), Q46_K_BYTES / Q6_K_BLOCK, _q4_k_or_q6_k_to_f32,
                           dequantise_q4_k_or_q6_k, lambda a: tagged_k_blocks(quantise_q6_k(a), "q6_k"),
                           Q6_K_BLOCK, Q46_K_BYTES, K_ACT_BLOCK),
    # not a GGUF type: its own codec, and float32 activations (no act_block: see the module doc)
    "fp8_e4m3": Format("fp8_e4m3", np.dtype(np.uint8), FP8_BYTES / FP8_BLOCK, _fp8_e4m3_to_f32, dequantise_fp8_e4m3,
                       quantise_fp8_e4m3, FP8_BLOCK, FP8_BYTES),
}


def rounded_to_bf16(x: jax.Array) -> jax.Array:
    """float32 values rounded to the nearest bf16 (ties to even), as float32 (XLA)."""
    return x.astype(jnp.bfloat16).astype(jnp.float32)


@functools.lru_cache(maxsize=None)
def on_bf16_tiles(fmt: Format) -> Format:
    """`fmt` as the host kernels' bf16 tiles multiply it in a prompt call (numerics="fast",
    `ftjax.host.tile_kind` "bf16"): the weights widened to bf16 (bf16 ones are already;
    a block format's dequantised values rounded to bf16, host_kernels/dequant.h) and the
    activations rounded to bf16 (x before gate / up, the SwiGLU product before down).
    The device half of such a record computes with it, so a prompt's result does not
    depend on which of its experts were cached (one object per format: a static
    argument of the jitted FFN)."""
    widen = fmt.to_f32 if fmt.name == "bfloat16" else \
        (lambda w, to_f32=fmt.to_f32: rounded_to_bf16(to_f32(w)))
    return dataclasses.replace(fmt, name=f"{fmt.name}@bf16_tiles", to_f32=widen, act_bf16=True)


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
    'bfloat16'; f32 alike; the block formats ('q8_0', 'q4_0', 'q4_k', 'q6_k', 'mxfp4',
    'fp8_e4m3') as named (a dtype such as int8 is not a format: `QUANTISED_ALIASES` are
    resolved where users name an expert dtype); a pool of two part formats
    'gate_up_format/down_format' (`pool_format`) part by part."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if "/" in name:
        return pool_format(*(canonical_dtype(n) for n in name.split("/", 1)))
    aliases = {"bf16": "bfloat16", "bfloat16": "bfloat16", "uint16": "bfloat16",
               "f32": "float32", "fp32": "float32", "float32": "float32", **{f: f for f in BLOCK_FORMATS}}
    if name not in aliases:
        raise ValueError(f"unsupported expert format {dtype!r} (formats: {', '.join(FORMATS)})")
    return aliases[name]


def pool_format(gate_up: str, down: str) -> str:
    """The format name of a pool whose parts are stored in `gate_up` and `down`: one name
    when they agree, else 'gate_up/down' (e.g. 'q4_k/q6_k', a GGUF Q4_K_M file's experts)."""
    return gate_up if gate_up == down else f"{gate_up}/{down}"


def part_formats(dtype: str) -> dict[str, Format]:
    """A pool's format name (`pool_format`) -> the Format of each expert part."""
    names = canonical_dtype(dtype).split("/")
    return dict(zip(EXPERT_PARTS, (FORMATS[names[0]], FORMATS[names[-1]])))


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
    """Expert (layer, e) of a pool pytree [Lm, E, ...] -> [1, ...] per part (traced ids:
    one slice of the pool, never a copy of the layer)."""
    return {k: jax.lax.dynamic_slice(a, (layer, e) + (0,) * (a.ndim - 2), (1, 1) + a.shape[2:])[0]
            for k, a in parts.items()}


def put_expert(cache: dict, expert: dict, slot) -> dict[str, jax.Array]:
    """cache [slots, ...] with slot <- expert [1, ...] (in place when the cache is donated)."""
    return {k: jax.lax.dynamic_update_index_in_dim(cache[k], expert[k], slot, 0) for k in cache}


def flat_rows(parts: dict) -> dict[str, jax.Array]:
    """[Lm, E, ...] -> [Lm*E, ...] per part: a free reshape, so a kernel can index the whole
    pool instead of a layer's slice (which XLA would copy)."""
    return {k: a.reshape(-1, *a.shape[2:]) for k, a in parts.items()}
