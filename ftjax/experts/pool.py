"""Host expert pool: every MoE layer's experts in host RAM, the runtime's source of truth.

Layout (Hugging Face fused form; the loader, the device cache and the C++ kernels
all index it the same way). Letters: Lm MoE layers, E experts, D model dim,
F expert FFN dim.

    gate_up [Lm, E, 2F, D]   rows 0..F-1 gate_proj, rows F..2F-1 up_proj
    down    [Lm, E, D, F]

Every weight row is one contiguous dot product, so a kernel streams an expert
front to back. Storage is float32, bfloat16 kept as its uint16 bit pattern (numpy has
no bf16 arithmetic and XLA CPU would convert whole buffers), or a GGUF block format
(q8_0 / q4_0 / mxfp4: each row a run of 32-weight blocks, q4_k / q6_k: of 256-weight
super-blocks, fp8_e4m3: of 128-weight blocks; uint8 [..., bytes(row)]); the two parts may
have different formats (dtype 'q4_k/q6_k': a GGUF Q4_K_M file); formats
are described in `ftjax.experts.storage`. Arrays are 64-byte aligned, which lets `jax.device_put`
alias them on the CPU backend and keeps SIMD loads on cache lines, and they are
read-only once built: the FFI handler holds raw pointers into them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ftjax.experts.storage import (  # noqa: F401  (re-exported: older imports)
    FORMATS, QUANTISED_ALIASES, bf16_bits_to_f32, canonical_dtype, expert_bytes, expert_parts, part_formats,
    pool_format, to_bf16_bits)

ALIGNMENT = 64
DTYPES = tuple(FORMATS)  # float32, bfloat16, q8_0, q4_0, q4_k, q6_k, mxfp4, fp8_e4m3 (or a pair: `pool_format`)


def aligned_empty(shape, dtype, alignment: int = ALIGNMENT) -> np.ndarray:
    """Uninitialised array whose data pointer is a multiple of `alignment`.

    The array is a view of a slightly larger uint8 buffer that numpy owns (kept
    alive through `.base`), so no custom deallocator is needed.
    """
    dtype = np.dtype(dtype)
    num_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(num_bytes + alignment, dtype=np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset : offset + num_bytes].view(dtype).reshape(shape)


def fill_rows(dst: np.ndarray, data: np.ndarray, rows: np.ndarray | None) -> None:
    """dst[:] = data along the leading (expert) axis; with `rows` (bool [E]) only those
    rows, read from `data` and written (a memmap's other rows are not read, the pool's
    not touched)."""
    if rows is None:
        dst[...] = data
    else:
        dst[rows] = data[rows]


def is_aligned(a: np.ndarray, alignment: int = ALIGNMENT) -> bool:
    return a.size == 0 or a.ctypes.data % alignment == 0  # an empty pool (all-dense model) has no data


def _as_storage(a: np.ndarray) -> tuple[np.ndarray, str]:
    """Any accepted input (float32, uint16 bf16 bits, ml_dtypes.bfloat16) -> storage."""
    a = np.asarray(a)
    if a.dtype == np.float32:
        return a, "float32"
    if a.dtype == np.uint16:
        return a, "bfloat16"
    if a.dtype.name == "bfloat16":  # ml_dtypes.bfloat16: same bits
        return a.view(np.uint16), "bfloat16"
    raise TypeError(f"expert weights must be float32 or bfloat16, got {a.dtype}")


def _aligned(a: np.ndarray) -> np.ndarray:
    """A view of `a` if it is already aligned and contiguous, else an aligned copy."""
    if is_aligned(a) and a.flags.c_contiguous:
        return a.view()  # freezing the view leaves the caller's array flags alone
    out = aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


@dataclasses.dataclass(eq=False)
class HostExpertPool:
    """All experts of all MoE layers in aligned host memory (see module docstring)."""

    gate_up: np.ndarray  # [Lm, E, 2F, D] (block formats: [Lm, E, 2F, bytes(D)] uint8)
    down: np.ndarray  # [Lm, E, D, F] (block formats: [Lm, E, D, bytes(F)] uint8)
    dtype: str  # a format name of `ftjax.experts.storage.FORMATS`, or 'gate_up/down' (`pool_format`)

    def __post_init__(self):
        try:
            if canonical_dtype(self.dtype) != self.dtype:
                raise ValueError
            fmts = part_formats(self.dtype)
        except ValueError:
            raise ValueError(f"dtype must be one of {DTYPES} (or 'gate_up_format/down_format'), "
                             f"got {self.dtype!r}") from None
        lm, e, two_f, _ = self.gate_up.shape
        d = fmts["gate_up"].row_len(self.gate_up.shape[3])
        if (two_f % 2 or self.gate_up.shape[3] != fmts["gate_up"].stored_shape((d,))[0]
                or self.down.shape != (lm, e, d, fmts["down"].stored_shape((two_f // 2,))[0])):
            raise ValueError(
                f"gate_up {self.gate_up.shape} and down {self.down.shape} are not "
                f"[Lm, E, 2F, D] and [Lm, E, D, F] stored as {self.dtype}"
            )
        for part, a in self.parts.items():
            if a.dtype != fmts[part].storage or not a.flags.c_contiguous or not is_aligned(a):
                raise ValueError("pool arrays must be C-contiguous, 64-byte aligned storage dtype")

    @classmethod
    def allocate(cls, num_layers: int, num_experts: int, d_model: int, d_ff: int,
                 dtype: str = "bfloat16") -> HostExpertPool:
        """Writable, uninitialised pool for a loader to fill; call `freeze()` after."""
        fmts = part_formats(dtype)
        gate_up = aligned_empty(fmts["gate_up"].stored_shape((num_layers, num_experts, 2 * d_ff, d_model)),
                                fmts["gate_up"].storage)
        down = aligned_empty(fmts["down"].stored_shape((num_layers, num_experts, d_model, d_ff)), fmts["down"].storage)
        return cls(gate_up, down, canonical_dtype(dtype))

    @classmethod
    def from_arrays(cls, gate_up: np.ndarray, down: np.ndarray, dtype: str | None = None) -> HostExpertPool:
        """Frozen pool from existing arrays: float32, bf16 bits (uint16) or
        ml_dtypes.bfloat16; or, with dtype = a block format, uint8 arrays of its blocks.
        Copied only if unaligned or not contiguous; otherwise the pool shares their memory
        and the caller must not write to them afterwards."""
        if dtype is not None and any(f.block > 1 for f in part_formats(dtype).values()):
            return cls(_aligned(np.asarray(gate_up)), _aligned(np.asarray(down)), canonical_dtype(dtype)).freeze()
        gate_up, dtype = _as_storage(gate_up)
        down, down_dtype = _as_storage(down)
        if dtype != down_dtype:
            raise TypeError(f"gate_up is {dtype} but down is {down_dtype}")
        return cls(_aligned(gate_up), _aligned(down), dtype).freeze()

    def converted(self, dtype: str) -> HostExpertPool:
        """A new frozen pool holding these experts in another format (quantising through
        float32; a layer at a time, so the float32 copy is one layer's)."""
        name = "/".join(QUANTISED_ALIASES.get(n, n) for n in dtype.split("/"))
        out = HostExpertPool.allocate(self.num_layers, self.num_experts, self.d_model, self.d_ff, name)
        src, dst = part_formats(self.dtype), part_formats(out.dtype)
        for m in range(self.num_layers):
            for part in dst:
                getattr(out, part)[m] = dst[part].from_f32_numpy(src[part].to_f32_numpy(getattr(self, part)[m]))
        return out.freeze()

    def dequantised(self, layer: int, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Expert (layer, e) as float32: gate_up [2F, D], down [D, F] (numpy twins)."""
        fmts = part_formats(self.dtype)
        return fmts["gate_up"].to_f32_numpy(self.gate_up[layer, e]), fmts["down"].to_f32_numpy(self.down[layer, e])

    def freeze(self) -> HostExpertPool:
        self.gate_up.flags.writeable = False
        self.down.flags.writeable = False
        return self

    @property
    def frozen(self) -> bool:
        return not (self.gate_up.flags.writeable or self.down.flags.writeable)

    @property
    def num_layers(self) -> int:
        return self.gate_up.shape[0]

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[1]

    @property
    def d_model(self) -> int:
        return part_formats(self.dtype)["gate_up"].row_len(self.gate_up.shape[3])

    @property
    def d_ff(self) -> int:
        return self.gate_up.shape[2] // 2

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (every part)."""
        return expert_bytes(self.parts)

    @property
    def parts(self) -> dict[str, np.ndarray]:
        """The pool as a parts pytree (see `ftjax.experts.storage`)."""
        return expert_parts(self)

    @property
    def layer_bytes(self) -> int:
        return self.expert_bytes * self.num_experts

    @property
    def total_bytes(self) -> int:
        return self.layer_bytes * self.num_layers

    def expert(self, layer: int, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Views (no copy) of expert e in MoE layer `layer`: gate_up [2F, D], down [D, F]
        as stored (block formats: rows of blocks; `dequantised` gives float32)."""
        return self.gate_up[layer, e], self.down[layer, e]
