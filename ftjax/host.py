"""The host boundary: the ONLY module whose code crosses from a jitted program into
host (CPU) kernels: the routed-expert FFN, and dense layers stored as bf16 bits or in a block format.

    jitted step --(x [T,D], layer [], ids [T,K], weights [T,K])--> expert_ffn --> y [T,D]
        CPU backend:  jax.ffi.ffi_call -> C++ XLA FFI handler (~2 us per call inside a step, async dispatch kept)
        other:        jax.pure_callback -> the same C++ kernel through nanobind (portable)

Both paths run the kernel in `host_kernels/` (SwiGLU over experts read in place
from the `HostExpertPool`, on a persistent `ThreadPool`), so results agree up to
float rounding. The FFI handler receives the pool's base addresses and the thread
pool's address as static attributes and the layer / expert ids as operands: one
compile serves every layer and every expert. Those addresses are raw pointers: the
`HostExecutor` holds the pool and must outlive every program traced with it. The choice of path is data (`Boundary`), made in `default_boundary`.

Dense layers (`linear`): on the CPU backend the matrix products of packed bf16
weights (attention projections, router, LM head) go to the C++ kernel through a
second FFI handler, the weight passed as an ordinary operand (a CPU "device" buffer
is host memory, read in place). XLA's own CPU dot on bf16 runs at 0.2-0.6 GB/s, and
converting the weight to f32 first costs ~18 ms per 4096x2048 matrix per call, so
the kernel wins at every prompt length measured (1..512 tokens). Other backends use
XLA's dot. Block-quantised matrices (`wtype=` a block format of
`ftjax.experts.storage.FORMATS`: uint8 rows [N, row bytes], GGUF's blocks) go the same
way: the kernel quantises the activations to int8 blocks once per call, as for block
experts; off the CPU backend XLA dequantises the matrix (the storage format's `to_f32`)
and the activations go through the same int8 rounding (`act`), so both paths compute
the same products.

Worker threads are process-wide (`shared_threads`): one persistent pool per thread
count, never freed, because compiled programs hold its address.

Letters: N output features, Lm MoE layers, E experts, D model dim, F expert FFN dim, T tokens, K top-k.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import os
import statistics
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from ftjax import _host_kernels as _hk
from ftjax.experts.pool import HostExpertPool
from ftjax.experts.storage import FORMATS, Format, bf16_bits_to_f32, format_of, on_bf16_tiles, part_formats, \
    round_to_bf16

# The C++ kernels' code for each expert format (host_kernels/kernels.h WeightType).
WEIGHT_TYPE_CODES = {"float32": _hk.DTYPE_F32, "bfloat16": _hk.DTYPE_BF16,
                     "q8_0": _hk.DTYPE_Q8_0, "q4_0": _hk.DTYPE_Q4_0, "q4_k": _hk.DTYPE_Q4_K,
                     "q6_k": _hk.DTYPE_Q6_K, "mxfp4": _hk.DTYPE_MXFP4, "fp8_e4m3": _hk.DTYPE_FP8_E4M3,
                     "q4_k_or_q6_k": _hk.DTYPE_Q4_K_OR_Q6_K}

FFI_TARGET = "ftjax_expert_ffn"
LINEAR_FFI_TARGET = "ftjax_linear"
ATTENTION_FFI_TARGET = "ftjax_attention"
WRITE_ROWS_FFI_TARGET = "ftjax_write_rows"
START_FFI_TARGET = "ftjax_expert_start"
FINISH_FFI_TARGET = "ftjax_expert_finish"


class Boundary(enum.Enum):
    """How a jitted program reaches the host kernel."""

    FFI_CPU = "ffi_cpu"  # XLA FFI custom call; CPU backend only
    CALLBACK = "callback"  # jax.pure_callback; any backend (copies, syncs, slower)


class Isa(enum.Enum):
    """Which SIMD path the kernel uses (AUTO: the widest one the CPU has)."""

    AUTO = _hk.ISA_AUTO
    SCALAR = _hk.ISA_SCALAR
    AVX2 = _hk.ISA_AVX2  # AVX2 + FMA
    AVX512 = _hk.ISA_AVX512  # AVX-512 F
    AVX512_BF16 = _hk.ISA_AVX512_BF16  # + BF16 and VNNI: bf16 weights meet bf16-rounded activations (asked for only)
    # AUTO's exact kernels, but prompt calls (>= AMX_MIN_TOKENS tokens: experts, dense
    # products, attention) on AMX tiles with bf16-rounded activations (asked for only;
    # numerics="fast" asks for it)
    AMX_BF16 = _hk.ISA_AMX_BF16
    # the same on a CPU without AMX: the tiles' layouts multiplied with vdpbf16ps (Zen 4/5;
    # numerics="fast" asks for it where AMX_BF16 is not available)
    AVX512_BF16_TILES = _hk.ISA_AVX512_BF16_TILES


AMX_MIN_TOKENS = _hk.AMX_MIN_TOKENS


def amx_bf16_status() -> str:
    """'' when AMX-BF16 tiles run here (CPUID, the OS's tile state and Linux's permission
    for this process, then a small product against a reference: host_kernels/amx.cc), else
    the reason they do not."""
    return _hk.amx_bf16_status()


def amx_int8_status() -> str:
    """'' when AMX-INT8 tiles run here (the same checks, its own CPUID bit and a Q8_0
    product against the integer reference), else the reason they do not. Q8_0 expert
    prefill takes them under AMX_BF16 (`takes_amx_tiles`)."""
    return _hk.amx_int8_status()


def bf16_vector_status() -> str:
    """'' when the bf16 tiles' vector form runs here (CPUID names AVX512-BF16, and a small
    product equals the reference: host_kernels/amx.cc), else the reason it does not.
    AVX512_BF16_TILES needs it."""
    return _hk.bf16_vector_status()


def int8_vector_status() -> str:
    """'' when the int8 tiles' vector form runs here (CPUID names AVX512-VNNI, and a small
    Q8_0, Q4_K and Q6_K product equals the reference: host_kernels/int8_vector.cc), else the
    reason it does not. Under AVX512_BF16_TILES, block-format weights take it."""
    return _hk.int8_vector_status()


def has_avx2() -> bool:
    return _hk.has_avx2()


def available_isas() -> list[Isa]:
    """The explicit ISAs this CPU can run, narrowest first. AUTO picks the widest exact one
    (`auto_isa`); AVX512_BF16 and the tile ISAs (`tile_isas`) round activations to bf16 and
    run when asked for."""
    supported = {Isa.SCALAR: True, Isa.AVX2: _hk.has_avx2(), Isa.AVX512: _hk.has_avx512(),
                 Isa.AVX512_BF16: _hk.has_avx512_bf16(), Isa.AMX_BF16: amx_bf16_status() == "",
                 Isa.AVX512_BF16_TILES: bf16_vector_status() == ""}
    return [isa for isa, ok in supported.items() if ok]


ISA_ENV = "FTJAX_ISA"  # what AUTO means, e.g. FTJAX_ISA=avx512 keeps float32 activations on a BF16 CPU
GEMV_PREFETCH_ENV = "FTJAX_GEMV_PREFETCH"  # bytes the decode GEMV prefetches into L2 (0: none)


def set_gemv_prefetch_from_env() -> None:
    """$FTJAX_GEMV_PREFETCH, when set, replaces the kernels' choice by CPU vendor of how far
    ahead the float / bf16 decode GEMV prefetches into L2 (4096 bytes on Intel, none
    elsewhere: host_kernels/kernels.h). Results never depend on it; a value that is not
    a whole number of 64-byte lines is an error naming the variable."""
    value = os.environ.get(GEMV_PREFETCH_ENV, "").strip()
    if not value:
        return
    n = int(value) if value.isdigit() else -1
    if n < 0 or n % 64:
        raise ValueError(f"${GEMV_PREFETCH_ENV}={value!r} is not a whole number of 64-byte lines (0 turns it off)")
    _hk.set_gemv_prefetch_bytes(n)


set_gemv_prefetch_from_env()


def auto_isa() -> Isa:
    """The widest exact ISA of this CPU: float32 activations meet every float weight (the
    C++ kernels' own choice for AUTO)."""
    return [i for i in available_isas() if i not in (Isa.AVX512_BF16, *tile_isas())][-1]


def tile_isas() -> tuple[Isa, Isa]:
    """The ISAs whose prompt calls multiply on the bf16 tiles: AMX_BF16 and its vector form."""
    return Isa.AMX_BF16, Isa.AVX512_BF16_TILES


def resolve_isa(isa: Isa = Isa.AUTO) -> Isa:
    """The ISA a kernel call runs with: an explicit one as given; AUTO as $FTJAX_ISA names
    it (scalar, avx2, avx512, avx512_bf16, amx_bf16), else `auto_isa`."""
    if isa is not Isa.AUTO:
        return isa
    name = os.environ.get(ISA_ENV, "").strip()
    if not name or name.lower() == "auto":
        return auto_isa()
    try:
        chosen = Isa[name.upper()]
    except KeyError:
        raise ValueError(f"${ISA_ENV}={name!r} is not an ISA ({', '.join(i.name.lower() for i in Isa)})") from None
    if chosen is not Isa.AUTO and chosen not in available_isas():
        raise ValueError(f"${ISA_ENV}={name!r}: this CPU has only {', '.join(i.name.lower() for i in available_isas())}")
    return chosen


def rounds_activations_to_bf16(isa: Isa = Isa.AUTO) -> bool:
    """Whether the kernels under `isa` round every activation that meets bf16 weights to
    bf16, as `vdpbf16ps` needs (AVX512_BF16; AMX_BF16 only in the expert calls of
    `takes_amx_tiles`; the other paths multiply float32 activations by the widened weights)."""
    return resolve_isa(isa) is Isa.AVX512_BF16


def expert_isa(numerics: str) -> Isa:
    """The ISA a model's host experts run with: under numerics="fast", AMX_BF16 where its
    self-check passed, else AVX512_BF16_TILES where that one passed (prompts on the bf16
    tiles or their vector form, activations rounded to bf16 as llama.cpp does; block-format
    weights on the int8 tiles or their VNNI vector form, activations int8; decode stays
    exact); else AUTO. $FTJAX_ISA, when set, decides."""
    if numerics == "fast" and not os.environ.get(ISA_ENV, "").strip():
        if amx_bf16_status() == "":
            return Isa.AMX_BF16
        if bf16_vector_status() == "":
            return Isa.AVX512_BF16_TILES
    return Isa.AUTO


def isa_report() -> dict[str, str | int]:
    """What the kernels run with on this machine, for benchmark lines and `ftjax profile`:
    the exact ISA AUTO means, the self-checks of the AMX tiles and of their vector forms
    ("ok" or why not), what numerics="fast" prefills with, and how far ahead the decode
    GEMV prefetches into L2."""
    return {"auto": auto_isa().name.lower(), "amx_bf16": amx_bf16_status() or "ok",
            "amx_int8": amx_int8_status() or "ok", "bf16_vector": bf16_vector_status() or "ok",
            "int8_vector": int8_vector_status() or "ok", "fast": expert_isa("fast").name.lower(),
            "gemv_prefetch_bytes": _hk.gemv_prefetch_bytes()}


def takes_amx_tiles(isa: Isa, num_tokens: int, d_model: int, d_ff: int, dtype: str) -> bool:
    """Whether an expert FFN call of `dtype` experts (a pool format name, or a pair
    'gate_up/down') multiplies on AMX tiles or their vector forms (which ones: `tile_kind`);
    the kernel's own rule (host_kernels/expert_ffn.cc `expert_ffn_takes_tiles`)."""
    parts = part_formats(dtype)
    return _hk.expert_ffn_takes_tiles(resolve_isa(isa).value, WEIGHT_TYPE_CODES[parts["gate_up"].name],
                                      WEIGHT_TYPE_CODES[parts["down"].name], d_model, d_ff, num_tokens)


def tile_kind(dtype: str, isa: Isa) -> str | None:
    """The tiles weights of format `dtype` multiply on under `isa` in a call that takes
    tiles: "bf16" (bf16, and the formats widened to bf16 row pass by row pass: Q4_K, Q6_K,
    Q4_K-or-Q6_K, Q8_0; activations rounded to bf16; on AMX or in the vector form), "int8"
    (Q8_0 under AMX_BF16 where AMX-INT8 passed its self-check: the exact path's int8 sums),
    "int8_vector" (Q8_0, Q4_K, Q6_K, Q4_K-or-Q6_K under AVX512_BF16_TILES where the int8
    vector form passed its self-check: the exact path's int8 activations and sums), or None
    (the exact kernels always); host_kernels/amx.cc `amx_tiles_for`."""
    return _hk.amx_tile_kind(resolve_isa(isa).value, WEIGHT_TYPE_CODES[dtype]) or None


def expert_formats(dtype: str, isa: Isa, d_model: int, d_ff: int, num_tokens: int) -> dict[str, Format]:
    """The part formats (`part_formats`) of `dtype` experts as the host kernel computes an
    expert FFN call of num_tokens tokens under isa: a prompt call on the bf16 tiles rounds
    weights and activations to bf16 (`on_bf16_tiles`), as AVX512_BF16 rounds every
    activation meeting bf16 weights; every other call (decode under the tile ISAs, the
    exact ISAs, the int8 tiles, whose activations are the exact path's) computes what the
    plain formats say. A model's device half computes with the same formats (whatever its
    policy), so where an expert runs changes a result only by the order of its f32 sums
    (which bf16 rounding downstream can turn into ~1e-2 in the logits; 0.12 when the
    device half kept f32 activations)."""
    fmts = part_formats(dtype)
    isa = call_isa(isa)
    if rounds_activations_to_bf16(isa):
        return {part: on_bf16_tiles(f) if f.name == "bfloat16" else f for part, f in fmts.items()}
    if not takes_amx_tiles(isa, num_tokens, d_model, d_ff, dtype):
        return fmts
    return {part: on_bf16_tiles(f) if tile_kind(f.name, isa) == "bf16" else f for part, f in fmts.items()}


def attention_takes_tiles(isa: Isa, num_tokens: int, head_dim: int) -> bool:
    """Whether `attention` of num_tokens query tokens per row (a prompt chunk: >= 16) with
    head_dim (a multiple of 32, <= 256) runs on the AMX-BF16 tiles under isa; the kernel's
    rule (host_kernels/attention_tiles.cc)."""
    return _hk.attention_takes_tiles(resolve_isa(isa).value, num_tokens, head_dim)


def linear_takes_tiles(isa: Isa, num_tokens: int, rows: int, cols: int, wtype: str) -> bool:
    """Whether a dense `linear` call of `wtype` weights [rows, cols] over num_tokens tokens
    multiplies on AMX tiles (the same weight types as `takes_amx_tiles`; rows a multiple of
    16); the kernel's rule (host_kernels/linear.cc `linear_takes_tiles`)."""
    return _hk.linear_takes_tiles(resolve_isa(isa).value, WEIGHT_TYPE_CODES[wtype], rows, cols, num_tokens)


def dequant_bf16_fast(dtype: str) -> bool:
    """Whether the AMX tiles widen `dtype` rows to bf16 with vector code on this CPU."""
    return _hk.dequant_bf16_fast(WEIGHT_TYPE_CODES[dtype])


def dequant_bf16(w: np.ndarray, wtype: str, simd: bool = True) -> np.ndarray:
    """A block format's rows (uint8 [N, row bytes]) widened to bf16 bits [N, K] as the AMX
    tiles widen them (simd, where `dequant_bf16_fast`), or by the kernels' scalar reference.
    Equals the format's numpy twin rounded to bf16 (host_kernels/dequant.h)."""
    fmt = FORMATS[wtype]
    w = np.ascontiguousarray(w).view(np.uint8).reshape(w.shape[0], -1)
    out = np.empty((w.shape[0], fmt.row_len(w.shape[1] // fmt.storage.itemsize)), np.uint16)
    _hk.dequant_bf16(w, WEIGHT_TYPE_CODES[wtype], out, simd)
    return out


def default_threads() -> int:
    """Cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_boundary(platform: str | None = None) -> Boundary:
    """The one place that maps a backend to a host-boundary strategy."""
    platform = platform or jax.default_backend()
    return Boundary.FFI_CPU if platform == "cpu" else Boundary.CALLBACK


_DENSE_THREADS: contextvars.ContextVar[int | None] = contextvars.ContextVar("ftjax_dense_threads", default=None)
_DENSE_ISA: contextvars.ContextVar[Isa] = contextvars.ContextVar("ftjax_dense_isa", default=Isa.AUTO)
_PROMPT: contextvars.ContextVar[bool] = contextvars.ContextVar("ftjax_prompt_program", default=True)


@contextlib.contextmanager
def dense_settings(threads: int | None, isa: Isa = Isa.AUTO, prompt: bool = True):
    """Within this block, `linear` traced into a program uses `threads` workers (None:
    every core the process may run on) and, unless a call names one, `isa` (AMX_BF16:
    calls of >= 16 tokens on AMX tiles, `linear_takes_tiles`). A loaded model traces its
    steps inside it, so `load(threads=N)` caps the dense kernel as well as the expert
    kernels, and numerics="fast" puts its prefill's dense products on the tiles too.
    prompt=False: a decode program, whose host calls never take the tiles whatever their
    row count (`call_isa`), so a session's decode numerics do not depend on how many
    other rows share its batch."""
    tokens = _DENSE_THREADS.set(threads), _DENSE_ISA.set(isa), _PROMPT.set(prompt)
    try:
        yield
    finally:
        for var, token in zip((_DENSE_THREADS, _DENSE_ISA, _PROMPT), tokens):
            var.reset(token)


def call_isa(isa: Isa) -> Isa:
    """The ISA a host call traced now runs with: `isa` (AUTO resolved), except that in a decode program
    (`dense_settings(prompt=False)`) a tile ISA gives way to `auto_isa` (exact). The
    kernels take the tiles for calls of >= 16 rows, and a decode batch can have that
    many: measured on the default model under fast, a session decoding in a batch of 16
    drifted from its decode alone by 0.009-0.016 in the logits and changed its greedy
    tokens after 13 steps (a batch of 4: 1e-4)."""
    isa = resolve_isa(isa)
    return auto_isa() if not _PROMPT.get() and isa in tile_isas() else isa


def dense_threads() -> int:
    return _DENSE_THREADS.get() or default_threads()


def dense_isa() -> Isa:
    """The ISA `dense_settings` names for the programs traced now (AUTO outside it)."""
    return _DENSE_ISA.get()


@functools.cache
def _register_ffi_targets() -> None:
    jax.ffi.register_ffi_target(FFI_TARGET, _hk.ffi_expert_ffn(), platform="cpu")
    jax.ffi.register_ffi_target(LINEAR_FFI_TARGET, _hk.ffi_linear(), platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION_FFI_TARGET, _hk.ffi_attention(), platform="cpu")
    jax.ffi.register_ffi_target(WRITE_ROWS_FFI_TARGET, _hk.ffi_write_rows(), platform="cpu")
    jax.ffi.register_ffi_target(START_FFI_TARGET, _hk.ffi_expert_start(), platform="cpu")
    jax.ffi.register_ffi_target(FINISH_FFI_TARGET, _hk.ffi_expert_finish(), platform="cpu")
    if CUDA_PAIR:  # the pair's stream-ordered CUDA handlers (host_kernels/async_experts_cuda.cc)
        jax.ffi.register_ffi_target(START_FFI_TARGET, _hk.ffi_expert_start_cuda(), platform="CUDA")
        jax.ffi.register_ffi_target(FINISH_FFI_TARGET, _hk.ffi_expert_finish_cuda(), platform="CUDA")


CUDA_PAIR = bool(_hk.built_with_cuda)  # this build has the CUDA handlers of the start / finish pair


def pair_available(platform: str | None = None) -> bool:
    """Whether the start / finish pair has handlers for this backend: the CPU FFI ones
    where the boundary is the FFI, the CUDA ones where the package was built with the
    CUDA toolkit."""
    platform = platform or jax.default_backend()
    return default_boundary(platform) is Boundary.FFI_CPU or (platform == "gpu" and CUDA_PAIR)


def pending_host_calls() -> int:
    """Host expert calls started (`HostExecutor.expert_ffn_start`) and not yet finished."""
    return _hk.pending_expert_calls()


def drop_host_calls(older_than_s: float = 0.0) -> int:
    """Wait for the queued host calls, then forget the uncollected ones done at least
    `older_than_s` ago -> how many. A step that failed between start and finish leaves
    its call behind; the runner forgets such calls itself a minute after they are done."""
    return _hk.drop_finished_calls(older_than_s)


def shared_threads(num_threads: int) -> _hk.ThreadPool:
    """The process's worker pool of `num_threads` threads (created once, never freed): the
    one the FFI handlers use for a `threads=num_threads` attribute."""
    return _hk.shared_thread_pool(num_threads)


def inject_host_fault(n: int = 1) -> None:
    """Test hook: the next `n` routed-expert host kernel calls in this process (the FFI
    handler, or the numpy entry point the callback boundary uses) fail with an "injected
    host kernel fault" error instead of running, as a failing kernel would; 0 clears. Costs
    the kernels one relaxed atomic load per call."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    _hk.inject_expert_faults(int(n))


def weight_format(w, wtype: str | None = None):
    """The storage `Format` of a dense matrix: named by `wtype` (a block format's uint8 rows
    need it), else told by w's dtype (float32, or uint16 bf16 bits). A name outside
    `storage.FORMATS`, or one that w's dtype does not store, is a ValueError naming both."""
    if wtype is None:
        return format_of(w)
    fmt = FORMATS.get(wtype)
    if fmt is None or fmt.storage != np.dtype(w.dtype):
        raise ValueError(f"weight type {wtype!r} does not describe a {np.dtype(w.dtype).name} matrix "
                         f"(types: {', '.join(f'{n} ({f.storage.name})' for n, f in FORMATS.items())})")
    return fmt


def linear(x: jax.Array, w: jax.Array, *, wtype: str | None = None, boundary: Boundary | str | None = None,
           isa: Isa = Isa.AUTO) -> jax.Array:
    """x [..., K] -> [..., N] float32 = x . w^T, w [N, K] uint16 (bf16 bits) or float32,
    the HF nn.Linear layout, or a block format's uint8 rows [N, row bytes] named by
    `wtype` ('q8_0', 'q4_0', 'q4_k', 'q6_k', ...; activations are int8-quantised per 32
    as the format's `act` says). Callable inside `jax.jit`; the path is picked at trace time."""
    fmt = weight_format(w, wtype)
    *lead, K = x.shape
    N = w.shape[0]
    if fmt.row_len(w.shape[1]) != K:
        raise ValueError(f"x has {K} features but the {fmt.name} matrix rows hold {fmt.row_len(w.shape[1])} weights")
    x2 = jnp.asarray(x, jnp.float32).reshape(-1, K)  # [T, K]
    boundary = Boundary(boundary) if boundary else default_boundary()
    if boundary is Boundary.FFI_CPU:
        _register_ffi_targets()
        call = jax.ffi.ffi_call(LINEAR_FFI_TARGET, jax.ShapeDtypeStruct((x2.shape[0], N), jnp.float32))
        isa = isa if isa is not Isa.AUTO else dense_isa()
        y = call(x2, w, wtype=np.int32(WEIGHT_TYPE_CODES[fmt.name]), threads=np.int64(dense_threads()),
                 isa=np.int32(call_isa(isa).value))
    else:
        y = fmt.act(x2) @ fmt.to_f32(w).T
    return y.reshape(*lead, N)


def quantise_activations_native(x: np.ndarray, block: int, isa: Isa = Isa.AUTO
                                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The host kernels' int8 activation quantiser under `isa` (scalar, or AVX2 for the SIMD
    tables): x [T, n] -> q [T, n] int8, d [T, n / block] float32 and, for block 256 (the K
    formats' ActQ8K), bsums [T, n / 16] int16, the sums of each 16 q (else [T, 0]). Its numpy
    twin is `storage.quantise_activations`."""
    x = np.ascontiguousarray(x, np.float32)
    T, n = x.shape
    q, d = np.empty((T, n), np.int8), np.empty((T, n // block), np.float32)
    bsums = np.empty((T, n // 16 if block == 256 else 0), np.int16)
    _hk.quantise_activations(x, block, q, d, bsums, resolve_isa(isa).value)
    return q, d, bsums


def linear_numpy(x: np.ndarray, w: np.ndarray, threads: int | None = None, isa: Isa = Isa.AUTO,
                 wtype: str | None = None) -> np.ndarray:
    """The same kernel called from numpy: x [T, K] float32, w [N, K] (or a block format's
    uint8 rows, named by `wtype`) -> y [T, N]."""
    code = -1 if wtype is None else WEIGHT_TYPE_CODES[weight_format(w, wtype).name]  # -1: told by w's dtype
    x = np.ascontiguousarray(x, np.float32)
    y = np.empty((x.shape[0], w.shape[0]), np.float32)
    _hk.linear(w, x, y, shared_threads(threads or default_threads()), resolve_isa(isa).value, code)
    return y


def reference_linear(x: np.ndarray, w: np.ndarray, wtype: str | None = None, isa: Isa = Isa.AUTO) -> np.ndarray:
    """numpy (float64) reference of `linear` under `isa`: x [T, K], w [N, K] (float32 or
    bf16 bits; or a block format's uint8 rows named by `wtype`, dequantised by the format's
    numpy twin), the activations quantised or rounded as the kernel does
    (`storage.quantise_activations`; bf16 under `rounds_activations_to_bf16` and on the bf16
    tiles, where block weights are widened to bf16 too: `linear_takes_tiles`, `tile_kind`)."""
    fmt = weight_format(w, wtype)
    x = np.asarray(x, np.float32)
    w32 = fmt.to_f32_numpy(np.asarray(w)).reshape(w.shape[0], -1)
    tiles = linear_takes_tiles(isa, len(x), w32.shape[0], w32.shape[1], fmt.name)
    if tiles and tile_kind(fmt.name, isa) == "bf16":
        x, w32 = round_to_bf16(x), round_to_bf16(w32)
    elif fmt.act_block:  # the exact kernels', the int8 tiles' and their vector form's int8 activations
        x = fmt.act_numpy(x)
    elif np.asarray(w).dtype == np.uint16 and rounds_activations_to_bf16(isa):
        x = round_to_bf16(x)
    return (x.astype(np.float64) @ w32.astype(np.float64).T).astype(np.float32)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, kv_len: jax.Array,
              window: int = 0, isa: Isa = Isa.AUTO) -> jax.Array:
    """Causal GQA attention of q [B, T, H, hd] over the keys s < kv_len[b] of a head-major
    cache k, v [B, G, S, hd] (f32 or bf16, read in place) -> [B, T, H, hd] float32, by the
    C++ kernel through XLA FFI (CPU backend; callable inside `jax.jit`). positions [B, T].
    isa AUTO: `dense_settings`' ISA; under AMX_BF16 a prompt chunk runs on the tiles
    (`attention_takes_tiles`: q, k, v and the softmax weights rounded to bf16)."""
    isa = call_isa(isa if isa is not Isa.AUTO else dense_isa())
    _register_ffi_targets()
    call = jax.ffi.ffi_call(ATTENTION_FFI_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(jnp.asarray(q, jnp.float32), k, v, jnp.asarray(positions, jnp.int32), jnp.asarray(kv_len, jnp.int32),
                window=np.int64(window), threads=np.int64(dense_threads()),
                isa=np.int32(isa.value))


def write_rows(cache: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
    """cache [B, G, S, hd] with rows [B, G, T, hd] (cast to the cache's dtype) written at
    row start[b] of each (b, g), by the C++ handler with its result aliased to the cache:
    inside a step that donates the cache, only the T new rows are written (CPU backend)."""
    _register_ffi_targets()
    call = jax.ffi.ffi_call(WRITE_ROWS_FFI_TARGET, jax.ShapeDtypeStruct(cache.shape, cache.dtype),
                            input_output_aliases={0: 0})
    return call(cache, rows.astype(cache.dtype), jnp.asarray(start, jnp.int32))


def attention_numpy(q, k, v, positions, kv_len, window: int = 0, threads: int | None = None,
                    isa: Isa = Isa.AUTO) -> np.ndarray:
    """The same kernel from numpy: k, v float32 or uint16 (bf16 bits)."""
    out = np.empty(np.shape(q), np.float32)
    _hk.attention(np.ascontiguousarray(q, np.float32), k, v, np.ascontiguousarray(positions, np.int32),
                  np.ascontiguousarray(kv_len, np.int32), int(window), out, shared_threads(threads or default_threads()),
                  resolve_isa(isa).value)
    return out


def reference_attention(q, k, v, positions, kv_len, window: int = 0) -> np.ndarray:
    """numpy (float64) reference of `attention`: q [B, T, H, hd], k / v [B, G, S, hd]."""
    q, k, v = np.asarray(q, np.float64), _weights_f64(k), _weights_f64(v)
    B, T, H, hd = q.shape
    G = k.shape[1]
    out = np.zeros((B, T, H, hd))
    for b in range(B):
        s = np.arange(int(kv_len[b]))
        for t in range(T):
            p = positions[b][t]
            visible = (s <= p) & ((s > p - window) if window else True)
            if not visible.any():
                continue
            for h in range(H):
                g = h // (H // G)
                scores = k[b, g, s] @ q[b, t, h] / np.sqrt(hd)
                scores = np.where(visible, scores, -np.inf)
                w = np.exp(scores - scores.max())
                out[b, t, h] = (w / w.sum()) @ v[b, g, s]
    return out.astype(np.float32)


class HostExecutor:
    """Runs expert FFNs on the CPU, reading weights in place from a frozen pool."""

    def __init__(self, pool: HostExpertPool, threads: int | None = None,
                 isa: Isa | str = Isa.AUTO, swiglu_limit: float | None = None):
        """swiglu_limit: clamped SwiGLU experts (DeepSeek-V4: gate <= limit, |up| <= limit);
        None: plain SwiGLU."""
        if not pool.frozen:
            raise ValueError("freeze() the pool first: the kernels hold raw pointers into it")
        self.pool = pool
        self.swiglu_limit = swiglu_limit
        self._limit = np.float32(np.inf if swiglu_limit is None else swiglu_limit)
        # each part's kernel type code (host_kernels/kernels.h WeightType), worked out once; the
        # numpy entry point names block types only (-1: plain types, told by the array dtype)
        fmts = part_formats(pool.dtype)
        self._codes = {part: WEIGHT_TYPE_CODES[f.name] for part, f in fmts.items()}
        self._array_codes = {part: self._codes[part] if f.block > 1 else -1 for part, f in fmts.items()}
        self.isa = resolve_isa(isa if isinstance(isa, Isa) else Isa[isa.upper()])
        self._threads = shared_threads(threads or default_threads())
        # {calls, nanoseconds in the kernel, distinct experts read}: the handler adds to it
        # at the end of every call (the callback path likewise); `work_done` reads it.
        self._work = np.zeros(3, np.int64)
        # The FFI handler finds the pool (and _work) by this id: programs hold no address,
        # so equal models compile to equal programs (the persistent compile cache serves
        # them). Unregistered when this executor is freed; its arrays live as long.
        self._pool_id = _hk.register_expert_pool(pool.gate_up.ctypes.data, pool.down.ctypes.data,
                                                 self._work.ctypes.data)
        weakref.finalize(self, _hk.unregister_expert_pool, self._pool_id)

    def work_done(self) -> tuple[int, float, int]:
        """(calls, seconds, experts) of host expert work since this executor was made: what
        online calibration (`ftjax.experts.calibration`) turns into a live B_H."""
        calls, ns, experts = (int(v) for v in self._work)
        return calls, ns * 1e-9, experts

    @property
    def num_threads(self) -> int:
        return self._threads.num_threads

    def expert_ffn(self, x, layer, ids, weights, *, boundary: Boundary | str | None = None) -> jax.Array:
        """y [T, D] f32 = sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]); ids < 0 are skipped.

        Callable inside `jax.jit` with traced x [T, D], layer [] (int), ids [T, K]
        (int), weights [T, K]; cast to f32 / s32 here. T is static (one compile per T).
        """
        boundary = Boundary(boundary) if boundary else default_boundary()
        args = (jnp.asarray(x, jnp.float32), jnp.asarray(layer, jnp.int32).reshape(()),
                jnp.asarray(ids, jnp.int32), jnp.asarray(weights, jnp.float32))
        if boundary is Boundary.FFI_CPU:
            return self._ffi_call(*args)
        return self._callback(*args)

    @property
    def overlaps(self) -> bool:
        """Whether `expert_ffn_start` / `expert_ffn_finish` have handlers on this backend."""
        return pair_available()

    def expert_ffn_start(self, x, layer, ids, weights) -> jax.Array:
        """Queue `expert_ffn(x, layer, ids, weights)` on the host runner and return at
        once -> a token [] int32 for `expert_ffn_finish`. Inside `jax.jit` (FFI boundary).
        The caller orders the device work it wants overlapped after the start by data
        (`after_start`) and before the finish (its `after` operand)."""
        _register_ffi_targets()
        call = jax.ffi.ffi_call(START_FFI_TARGET, jax.ShapeDtypeStruct((), jnp.int32), has_side_effect=True)
        return call(jnp.asarray(x, jnp.float32), jnp.asarray(layer, jnp.int32).reshape(()),
                    jnp.asarray(ids, jnp.int32), jnp.asarray(weights, jnp.float32), **self._ffi_attributes())

    @staticmethod
    def after_start(token, a) -> jax.Array:
        """`a` made to depend on the start: a + min(token, 0), which is `a` (tokens are
        >= 0) but which XLA cannot fold away, not knowing the sign. (An
        optimization_barrier does not do: XLA removes barriers before it schedules.)"""
        return a + jnp.minimum(token, 0).astype(a.dtype)

    def expert_ffn_finish(self, token, after, shape: tuple[int, int]) -> jax.Array:
        """Wait for the token's call -> y [T, D] f32 (zeros for token 0: nothing ran).
        `after` (any array) is computed before the wait: the overlapped device work."""
        call = jax.ffi.ffi_call(FINISH_FFI_TARGET, jax.ShapeDtypeStruct(shape, jnp.float32), has_side_effect=True)
        return call(token, after)

    def expert_ffn_numpy(self, x, layer, ids, weights, out: np.ndarray | None = None,
                         isa: Isa | None = None) -> np.ndarray:
        """Same computation, called directly from numpy (no jit); releases the GIL. isa:
        instead of the executor's own."""
        x = np.ascontiguousarray(x, np.float32)  # [T, D]
        y = np.empty_like(x) if out is None else out  # [T, D]
        _hk.expert_ffn(self.pool.gate_up, self.pool.down, int(layer), x,
                       np.ascontiguousarray(ids, np.int32), np.ascontiguousarray(weights, np.float32),
                       y, self._threads, (isa or self.isa).value, self._array_codes["gate_up"],
                       self._array_codes["down"], float(self._limit))
        return y

    def _ffi_attributes(self) -> dict:
        p = self.pool
        return dict(
            pool_id=np.int32(self._pool_id),
            num_layers=np.int64(p.num_layers), num_experts=np.int64(p.num_experts),
            d_model=np.int64(p.d_model), d_ff=np.int64(p.d_ff),
            dtype=np.int32(self._codes["gate_up"]), down_dtype=np.int32(self._codes["down"]),
            swiglu_limit=self._limit, threads=np.int64(self._threads.num_threads),
            isa=np.int32(call_isa(self.isa).value))

    def _ffi_call(self, x, layer, ids, weights):
        _register_ffi_targets()
        call = jax.ffi.ffi_call(FFI_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32))
        return call(x, layer, ids, weights, **self._ffi_attributes())

    def _callback(self, x, layer, ids, weights):
        out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
        host_fn = functools.partial(self._callback_host, isa=call_isa(self.isa))  # decided when traced
        return jax.pure_callback(host_fn, out, x, layer, ids, weights)

    def _callback_host(self, x, layer, ids, weights, isa: Isa) -> np.ndarray:
        start = time.perf_counter_ns()
        ids = np.asarray(ids)
        y = self.expert_ffn_numpy(np.asarray(x), int(np.asarray(layer)), ids, np.asarray(weights), isa=isa)
        self._work += (1, time.perf_counter_ns() - start, np.unique(ids[ids >= 0]).size)
        return y


@functools.cache
def memory_kinds() -> frozenset[str]:
    """The memory kinds the default device can address ('device', 'pinned_host',
    'unpinned_host' on the CPU and GPU backends); fixed for the process."""
    return frozenset(m.kind for m in jax.devices()[0].addressable_memories())


def sharding(memory_kind: str = "device") -> jax.sharding.Sharding:
    """The default device, in `memory_kind` where the backend has memory kinds."""
    kind = memory_kind if memory_kind in memory_kinds() else None
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def pool_view(pool: HostExpertPool, memory_kind: str = "pinned_host", placement=None) -> dict[str, jax.Array]:
    """The pool as arrays the jitted steps can read rows from (to fill cache slots).

    memory_kind: "pinned_host" (the runtime's placement: the steps move the rows they
    fetch into device memory explicitly, `executor.to_device`) or "device" (the `device`
    reference policy: every expert on the device). On the CPU backend both are zero-copy
    aliases of the pool's aligned RAM. On an accelerator "device" is a full device copy,
    and "pinned_host" a pinned copy of the pool (not yet run on a GPU).
    A backend without memory kinds gets its default memory. placement: a
    `ftjax.placement.Placement` (a mesh: every device sees the whole pool; on the CPU
    backend each device's view aliases the same RAM).
    """
    if placement is None:
        return jax.device_put(pool.parts, sharding(memory_kind))
    return placement.put(pool.parts, placement.replicated(memory_kind))


def memory_kind_of(tree) -> str | None:
    """The memory kind of a pytree's arrays (None: empty tree); mixed kinds are an error."""
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)}
    if len(kinds) > 1:
        raise ValueError(f"mixed memory kinds {sorted(kinds)}")
    return kinds.pop() if kinds else None


def read_bandwidth_samples(threads: int | None = None, num_bytes: int = 256 << 20,
                           repeats: int = 5, isa: Isa = Isa.AUTO) -> list[float]:
    """GB/s of each of `repeats` rounds summing a `num_bytes` buffer with `threads`
    workers: the read bandwidth that a kernel streaming expert weights should not beat. A
    round reads the buffer once per stream count of the probe (each worker's chunk as 1,
    2, 4 and 8 sequential streams side by side: `_hk.sum_streams`) and keeps the fastest,
    since how many streams a core keeps in flight decides what it reads (after a warm-up
    pass of each)."""
    pool = _hk.ThreadPool(threads or default_threads())
    return list(_hk.read_bandwidth_gbps(pool, num_bytes, repeats, resolve_isa(isa).value))


def read_bandwidth_gbps(threads: int | None = None, num_bytes: int = 256 << 20,
                        repeats: int = 5, isa: Isa = Isa.AUTO) -> float:
    """Median of `read_bandwidth_samples`."""
    return statistics.median(read_bandwidth_samples(threads, num_bytes, repeats, isa))


def _weights_f64(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == np.uint16:
        a = bf16_bits_to_f32(a)
    return a.astype(np.float64)


def reference_expert_ffn(gate_up: np.ndarray, down: np.ndarray, layer: int, x: np.ndarray,
                         ids: np.ndarray, weights: np.ndarray, dtype: str | None = None,
                         swiglu_limit: float | None = None, isa: Isa = Isa.AUTO) -> np.ndarray:
    """numpy (float64) reference of the kernel: gate_up [Lm, E, 2F, D], down
    [Lm, E, D, F] (float32 or bf16 bits; or a block format's uint8 rows, named by
    `dtype` (a pool format name: 'q4_k/q6_k' for two part formats), dequantised by the
    format's numpy twin: the gguf package's for the GGUF types), x [T, D], ids / weights [T, K] -> y [T, D],
    the activations quantised or rounded, and block weights widened to bf16, as the kernel
    under `isa` does (a call on the bf16 tiles: `takes_amx_tiles`, `tile_kind`)."""
    fmts = part_formats(dtype) if dtype is not None else None
    parts = {"gate_up": gate_up, "down": down}
    d_ff = gate_up.shape[-2] // 2
    bf16 = all(np.asarray(a).dtype == np.uint16 for a in parts.values())
    dtype = dtype or ("bfloat16" if bf16 else "float32")
    tiles = takes_amx_tiles(isa, len(x), x.shape[-1], d_ff, dtype)
    kinds = {part: tile_kind(f.name, isa) if tiles else None for part, f in part_formats(dtype).items()}

    def f64(a, part):  # weights widened to bf16 on the bf16 tiles (dequant.h)
        w = fmts[part].to_f32_numpy(a) if fmts else _weights_f64(a)
        return (round_to_bf16(w) if fmts and kinds[part] == "bf16" else w).astype(np.float64)

    def act(v, part):  # block formats meet int8-quantised activations (storage.quantise_activations)
        if kinds[part] == "bf16" or (np.asarray(parts[part]).dtype == np.uint16 and rounds_activations_to_bf16(isa)):
            return round_to_bf16(v).astype(np.float64)
        if fmts and fmts[part].act_block:
            return fmts[part].act_numpy(v).astype(np.float64)
        return v

    experts: dict[tuple[str, int], np.ndarray] = {}  # each expert's weights decoded once

    def expert(part, e):
        if (part, e) not in experts:
            experts[part, e] = f64(parts[part][layer, e], part)
        return experts[part, e]

    x = np.asarray(x, np.float64)
    y = np.zeros_like(x)  # [T, D]
    for t, k in zip(*np.nonzero(np.asarray(ids) >= 0)):
        e = int(ids[t, k])
        gu = expert("gate_up", e) @ act(x[t], "gate_up")  # [2F]
        gate, up = gu[:d_ff], gu[d_ff:]
        if swiglu_limit is not None:  # clamped SwiGLU
            gate, up = np.minimum(gate, swiglu_limit), np.clip(up, -swiglu_limit, swiglu_limit)
        h = gate / (1.0 + np.exp(-gate)) * up  # [F]
        y[t] += weights[t, k] * (expert("down", e) @ act(h, "down"))
    return y.astype(np.float32)
