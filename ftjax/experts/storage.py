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

   The block formats keep GGUF's bytes exactly: a matrix [rows, n] is stored as uint8
   [rows, n/32 * block_bytes], each row a run of blocks, so quantising at load and
   reading a .gguf file's Q8_0 / Q4_0 tensors give the same pool, and the host kernels
   (host_kernels/kernels.h) read either in place. Group size 32 with f16 scales is
   GGUF's choice: an f16 scale costs what a bf16 one does and keeps 3 more mantissa bits.
   Quantisation itself is the `gguf` package's (the reference quantiser llama.cpp's
   Python tools use), so a pool quantised here is bit-identical to llama.cpp's Q8_0 /
   Q4_0 of the same weights. A block format's storage dtype (uint8) does not name it:
   the pool carries its format name, and code that decodes weights is given the format.

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


QUANT_BLOCK = 32  # weights per block of the block formats


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


def quantise_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy twin of the host kernels' activation quantiser (host_kernels/kernels.h ActQ8):
    x [..., n] (n % 32 == 0) -> q [..., n] int8, d [..., n/32] float32, per 32 values
    d = max|x| / 127 and q = round-half-even(x * (1 / d)), all in float32."""
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


def _gguf_codec(name: str):
    """(quantise, dequantise) numpy functions of a GGUF block type, from the gguf package
    (imported on first use)."""

    def quantise(a: np.ndarray) -> np.ndarray:
        from gguf import GGMLQuantizationType, quants

        a = np.asarray(a, np.float32)
        if a.shape[-1] % QUANT_BLOCK:
            raise ValueError(f"{name} needs rows of a multiple of {QUANT_BLOCK} weights, got {a.shape[-1]}")
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


def _block_format(name: str, block_bytes: int, to_f32) -> Format:
    quantise, dequantise = _gguf_codec(name)
    return Format(name, np.dtype(np.uint8), block_bytes / QUANT_BLOCK, to_f32, dequantise, quantise,
                  QUANT_BLOCK, block_bytes, act_q8)


FORMATS: dict[str, Format] = {
    "float32": Format("float32", np.dtype(np.float32), 4, lambda w: w.astype(jnp.float32),
                      lambda a: np.asarray(a, np.float32), lambda a: np.asarray(a, np.float32)),
    "bfloat16": Format("bfloat16", np.dtype(np.uint16), 2, _bf16_to_f32, bf16_bits_to_f32, to_bf16_bits),
    "q8_0": _block_format("q8_0", 34, _q8_0_to_f32),
    "q4_0": _block_format("q4_0", 18, _q4_0_to_f32),
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
    'bfloat16'; f32 alike; 'q8_0' / 'q4_0' as named (a dtype such as int8 is not a
    format: `QUANTISED_ALIASES` are resolved where users name an expert dtype)."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    aliases = {"bf16": "bfloat16", "bfloat16": "bfloat16", "uint16": "bfloat16",
               "f32": "float32", "fp32": "float32", "float32": "float32", "q8_0": "q8_0", "q4_0": "q4_0"}
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
