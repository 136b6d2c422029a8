"""Expert prefill on the CPU: ftjax's host expert kernel per ISA path against oneMKL's
GEMM on the same products, in one run.

One MoE layer of OLMoE-1B-7B's experts (E = 64, D = 2048, F = 1024, top-8; bf16, or a
block format with --dtype: q8_0, q4_k, q4_k/q6_k = llama.cpp's Q4_K_M experts) and a
prompt of T tokens routed at random (each token to 8 distinct experts: ~T / 8 tokens an
expert). For each thread count:
    ftjax   HostExecutor.expert_ffn_numpy under each ISA this CPU has (AUTO's exact
            kernels, AVX512_BF16, AMX_BF16 — for Q8_0 experts AMX_BF16 means the AMX-INT8
            tiles, for Q4_K / Q6_K the bf16 tiles on rows widened pass by pass —, and
            AVX512_BF16_TILES: bf16 experts on AVX512-BF16 vectors, block formats on the
            int8 vector form, AVX512-VNNI; host.tile_kind): the whole layer (gather,
            gate/up, SwiGLU, down, weighted scatter).
    mkl     for each expert's gate/up [n, 2F] and down [n, D] products only (activations
            already gathered and converted: a lower bound on a layer built on it), the
            experts split over the threads, MKL's sequential layer in each:
            cblas_gemm_bf16bf16f32 for bf16; for the block formats cblas_gemm_s8u8s32,
            the same int8 multiply-adds with one scale per matrix — a scale per 32 weights
            (or per 16) is not a GEMM MKL has, so this bounds what a library int8 GEMM
            could do, it does not compute the layer. libmkl_rt is found in --mkl-lib or in this environment's
            `mkl` wheel (pip install mkl); absent, the line says CANNOT TEST.
Medians of --rounds; one JSON line per (system, path, threads), then a verdict line.

    OPENBLAS_NUM_THREADS=1 python scripts/bench_expert_prefill.py [--tokens 512] [--threads 1 2] [--dtype q8_0]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ftjax.experts.pool import HostExpertPool, to_bf16_bits
from ftjax.host import HostExecutor, Isa, auto_isa, available_isas, tile_isas
from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields

E, D, F, TOP_K = 64, 2048, 1024, 8  # OLMoE-1B-7B's experts


def make_pool(rng, dtype: str = "bfloat16") -> HostExpertPool:
    pool = HostExpertPool.allocate(1, E, D, F, "bfloat16")
    for a in (pool.gate_up, pool.down):  # random bits per expert (the products must not be trivial)
        for e in range(E):
            a[0, e] = to_bf16_bits((rng.standard_normal(a.shape[2:], np.float32) * 0.02))
    return pool.freeze() if dtype == "bfloat16" else pool.converted(dtype)


def routing(rng, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = rng.standard_normal((tokens, D)).astype(np.float32)  # [T, D]
    ids = np.stack([rng.permutation(E)[:TOP_K] for _ in range(tokens)]).astype(np.int32)  # [T, K]
    weights = rng.random((tokens, TOP_K)).astype(np.float32)
    return x, ids, weights / weights.sum(1, keepdims=True)


def timed(fn, rounds: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# ---- oneMKL ---------------------------------------------------------------------------------------

def find_mkl(given: str | None) -> Path | None:
    for folder in ([Path(given)] if given else []) + [Path(sys.prefix) / "lib"]:
        hits = sorted(folder.glob("libmkl_rt.so*"))
        if hits:
            return hits[0]
    return None


class MklGemm:
    """cblas_gemm_bf16bf16f32 (bf16) or cblas_gemm_s8u8s32 (int8) through ctypes, MKL's
    sequential threading layer."""

    def __init__(self, lib: Path, int8: bool = False):
        os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")
        self.mkl = ctypes.CDLL(str(lib))
        self.mkl.MKL_Set_Threading_Layer(1)  # MKL_THREADING_SEQUENTIAL
        self.int8 = int8
        p, i64, f32 = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_float
        if int8:
            self.fn = self.mkl.cblas_gemm_s8u8s32
            self.fn.argtypes = ([ctypes.c_int] * 4 + [i64] * 3 + [f32, p, i64, ctypes.c_int8, p, i64, ctypes.c_uint8, f32,
                                                                   p, i64, p])
            self.offset = np.zeros(1, np.int32)
        else:
            self.fn = self.mkl.cblas_gemm_bf16bf16f32
            self.fn.argtypes = [ctypes.c_int] * 3 + [i64] * 3 + [f32, p, i64, p, i64, f32, p, i64]

    @property
    def name(self) -> str:
        return "cblas_gemm_s8u8s32" if self.int8 else "cblas_gemm_bf16bf16f32"

    def xwt(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        """out [M, N] = x [M, K] . w [N, K]^T, row-major: bf16 bits, or int8 x and uint8 w."""
        (m, k), n = x.shape, w.shape[0]
        if self.int8:  # CblasFixOffset, no offsets: out int32
            self.fn(101, 111, 112, 171, m, n, k, 1.0, x.ctypes.data, k, 0, w.ctypes.data, k, 0, 0.0, out.ctypes.data,
                    n, self.offset.ctypes.data)
        else:
            self.fn(101, 111, 112, m, n, k, 1.0, x.ctypes.data, k, w.ctypes.data, k, 0.0, out.ctypes.data, n)


def mkl_layer(gemm: MklGemm, pool: HostExpertPool, x: np.ndarray, ids: np.ndarray, threads: int):
    """A function doing every expert's two products, experts split over `threads` (int8, or
    bf16 for block-format experts: random values of the experts' shapes; the products' time
    does not depend on values)."""
    rng = np.random.default_rng(1)
    if gemm.int8:
        weights = {e: (rng.integers(0, 256, (2 * F, D), np.uint8), rng.integers(0, 256, (D, F), np.uint8))
                   for e in range(E)}
    elif pool.dtype != "bfloat16":
        weights = {e: (to_bf16_bits(rng.standard_normal((2 * F, D), np.float32) * 0.02),
                       to_bf16_bits(rng.standard_normal((D, F), np.float32) * 0.02)) for e in range(E)}
    else:
        weights = {e: (pool.gate_up[0, e], pool.down[0, e]) for e in range(E)}
    per_expert = []
    for e in range(E):
        tokens = np.nonzero((ids == e).any(1))[0]
        if tokens.size:
            h = np.random.default_rng(e).standard_normal((tokens.size, F), np.float32)
            if gemm.int8:
                xe, he = rng.integers(-127, 128, (tokens.size, D), np.int8), rng.integers(-127, 128, h.shape, np.int8)
            else:
                xe, he = to_bf16_bits(x[tokens]), to_bf16_bits(h)  # [n, D], [n, F]
            out = np.int32 if gemm.int8 else np.float32
            per_expert.append((weights[e], xe, he, np.empty((tokens.size, 2 * F), out),
                               np.empty((tokens.size, D), out)))
    shares = [per_expert[i::threads] for i in range(threads)]

    def run_share(share):
        for (gate_up, down), xe, he, gu, y in share:
            gemm.xwt(xe, gate_up, gu)
            gemm.xwt(he, down, y)

    def layer():
        workers = [threading.Thread(target=run_share, args=(s,)) for s in shares[1:]]
        for w in workers:
            w.start()
        run_share(shares[0])
        for w in workers:
            w.join()
    return layer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", choices=["bfloat16", "q8_0", "q4_k", "q4_k/q6_k"], default="bfloat16",
                   help="the experts' format")
    p.add_argument("--mkl-lib", default=None, help="folder holding libmkl_rt.so (default: this environment's lib)")
    add_allow_dirty_argument(p)
    args = p.parse_args()
    check_clean_or_exit(args.allow_dirty)
    lib = find_mkl(args.mkl_lib)
    if lib and str(lib.parent) not in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        # libmkl_rt opens its other libraries by name: start again with their folder searched
        env = {**os.environ, "LD_LIBRARY_PATH": ":".join(filter(None, [str(lib.parent), os.environ.get("LD_LIBRARY_PATH")]))}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    rng = np.random.default_rng(0)
    pool = make_pool(rng, args.dtype)
    x, ids, weights = routing(rng, args.tokens)
    flops = 2 * args.tokens * TOP_K * 3 * D * F
    common = {"bench": "expert_prefill", "tokens": args.tokens, "experts": E, "expert_shape": [D, F], "top_k": TOP_K,
              "dtype": args.dtype, **commit_info(), "machine": machine_info(), **run_fields()}
    lines = []

    def emit(**fields):
        line = {**common, **fields}
        if "seconds" in fields:
            line.update(ms=round(1e3 * fields["seconds"], 2), tokens_per_s=round(args.tokens / fields["seconds"], 1),
                        tflops=round(flops / fields["seconds"] / 1e12, 3))
            del line["seconds"]
        lines.append(line)
        print(json.dumps(line), flush=True)

    isas = [i for i in available_isas() if i in (Isa.AVX512, Isa.AVX2, Isa.AVX512_BF16, *tile_isas())]
    int8 = args.dtype != "bfloat16"  # block formats: the int8 GEMM (the vector form's products)
    gemm = MklGemm(lib, int8=int8) if lib else None
    for threads in args.threads:
        for isa in isas:
            ex = HostExecutor(pool, threads=threads, isa=isa)
            y = np.empty_like(x)
            t = timed(lambda: ex.expert_ffn_numpy(x, 0, ids, weights, out=y), args.rounds)
            emit(system="ftjax", path=isa.name.lower(), threads=threads, seconds=statistics.median(t),
                 best_ms=round(1e3 * min(t), 2), scope="whole layer")
        if gemm is None:
            emit(system="mkl", path="cblas_gemm_s8u8s32" if int8 else "cblas_gemm_bf16bf16f32",
                 threads=threads, status="CANNOT TEST: no libmkl_rt.so (pip install mkl, or --mkl-lib DIR)")
            continue
        t = timed(mkl_layer(gemm, pool, x, ids, threads), args.rounds)
        emit(system="mkl", path=gemm.name, threads=threads, seconds=statistics.median(t),
             best_ms=round(1e3 * min(t), 2), scope="the two GEMMs per expert only", mkl_lib=str(lib))
    verdicts = []
    for threads in args.threads:
        ours = [x for x in lines if x["system"] == "ftjax" and x["threads"] == threads and "ms" in x]
        mkl = next((x for x in lines if x["system"] == "mkl" and x["threads"] == threads and "ms" in x), None)
        best = min(ours, key=lambda x: x["ms"])
        exact = next(x for x in ours if x["path"] == auto_isa().name.lower())  # AUTO's exact kernels
        v = (f"{threads} threads: best ftjax path {best['path']} {best['ms']} ms "
             f"({exact['ms'] / best['ms']:.2f}x the exact {exact['path']})")
        v += (f"; mkl GEMMs alone {mkl['ms']} ms: ftjax {mkl['ms'] / best['ms']:.2f}x mkl" if mkl
              else "; mkl CANNOT TEST")
        verdicts.append(v)
    print(json.dumps({**common, "bench": "expert_prefill_verdict", "verdicts": verdicts}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
