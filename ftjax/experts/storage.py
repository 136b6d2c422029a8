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

   Quantised formats (int8 / int4 group-wise, FP8 block, MXFP4) join this table as rows
   with more than one array per matrix (values + scales); everything below treats an
   expert as a pytree of named parts, so they slot in without new code paths.

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


@dataclasses.dataclass(frozen=True)
class Format:
    """How one matrix is stored (see the module table)."""

    name: str
    storage: np.dtype  # numpy dtype of the stored array
    bytes_per_weight: float
    to_f32: Callable[[jax.Array], jax.Array]  # device: storage -> float32
    to_f32_numpy: Callable[[np.ndarray], np.ndarray]
    from_f32_numpy: Callable[[np.ndarray], np.ndarray]  # float32 -> storage (rounds)


FORMATS: dict[str, Format] = {
    "float32": Format("float32", np.dtype(np.float32), 4, lambda w: w.astype(jnp.float32),
                      lambda a: np.asarray(a, np.float32), lambda a: np.asarray(a, np.float32)),
    "bfloat16": Format("bfloat16", np.dtype(np.uint16), 2, _bf16_to_f32, bf16_bits_to_f32, to_bf16_bits),
}
_BY_STORAGE = {f.storage: f for f in FORMATS.values()}


def format_of(a) -> Format:
    """The format an array is stored in, from its dtype (uint16 = bf16 bits)."""
    dtype = np.dtype(a.dtype)
    if dtype not in _BY_STORAGE:
        raise TypeError(f"no weight format is stored as {dtype} (formats: {', '.join(FORMATS)})")
    return _BY_STORAGE[dtype]


def as_f32(w: jax.Array) -> jax.Array:
    """Any stored matrix -> float32 on the device (other float dtypes are upcast)."""
    if w.dtype == jnp.uint16:
        return _bf16_to_f32(w)
    return w.astype(jnp.float32)


def canonical_dtype(dtype) -> str:
    """'bf16' | 'bfloat16' | np.uint16 | ml_dtypes.bfloat16 -> 'bfloat16'; f32 alike."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    aliases = {"bf16": "bfloat16", "bfloat16": "bfloat16", "uint16": "bfloat16",
               "f32": "float32", "fp32": "float32", "float32": "float32"}
    if name not in aliases:
        raise ValueError(f"unsupported expert dtype {dtype!r}")
    return aliases[name]


# ---- expert parts ---------------------------------------------------------------------

def expert_part_shapes(d_model: int, d_ff: int) -> dict[str, tuple[int, ...]]:
    """Shape of each part of ONE expert: gate_up [2F, D], down [D, F]."""
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
