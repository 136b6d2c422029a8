"""Quantised experts: quality and speed of the expert formats (int8 = Q8_0, int4 = Q4_0, Q4_K,
Q6_K, MXFP4, FP8 e4m3, and Q4_K gate/up with Q6_K down) against bf16.

One JSON line per measurement (with commit and machine):

    quant_ppl     held-out perplexity of the embedded default model, per expert format
    quant_kernel  the host expert kernel alone on OLMoE-1B-7B expert shapes (D 2048,
                  F 1024, 64 experts (--experts), top-8): a decode call (1 token, GB/s of
                  expert bytes read, with the machine's read ceiling) and a 512-token
                  prefill call (tokens/s), at 1 and 2 threads, per format (--formats)
    quant_model   a whole model (`--model`, e.g. the OLMoE geometry checkpoint of
                  `make_geometry_checkpoint.py --family olmoe`) on the host policy: steady
                  decode tok/s and 512-token prompt tok/s, per format, dense storage
                  (`--dense-dtypes`: "default" keeps a GGUF's Q8_0 / ... dense matrices as
                  stored, "float32" dequantises them, "int8" quantises a folder's at load)
                  and thread count, with the dense bytes a decode step streams and its read
                  roofline (the read ceiling probed right after, at the same threads, over
                  the dense + expert bytes of a step)

    OPENBLAS_NUM_THREADS=1 python scripts/bench_quant.py [--skip-ppl] [--model /tmp/geom-olmoe]
        [--formats bfloat16 q6_k fp8_e4m3 ...] [--experts 16] [--dense-dtypes default float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import ftjax  # noqa: E402
from ftjax.bench.models import decode_weight_bytes  # noqa: E402
from ftjax.bench.quality import held_out_nll  # noqa: E402
from ftjax.experts.pool import HostExpertPool, to_bf16_bits  # noqa: E402
from ftjax.host import HostExecutor, read_bandwidth_gbps  # noqa: E402
from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields  # noqa: E402,E501

FORMATS = {"bfloat16": "bfloat16", "int8": "q8_0", "int4": "q4_0", "q4_k": "q4_k", "q6_k": "q6_k",
           "mxfp4": "mxfp4", "fp8_e4m3": "fp8_e4m3", "q4_k/q6_k": "q4_k/q6_k", "q4_k_or_q6_k": "q4_k_or_q6_k"}


def emit(kind: str, **fields) -> None:
    print(json.dumps({"bench": kind, **commit_info(), "machine": machine_info(), **fields, **run_fields()}), flush=True)


def perplexity(tokens: int, formats: list[str]) -> None:
    from ftjax.config import ConfigError
    from ftjax.data import corpus

    base = ftjax.load(policy="host")
    text = "".join(corpus.split(name)[1] for name in corpus.names())
    ids = base.tokenizer.encode(text)[: tokens + 1]
    ref = None
    for name in ["bfloat16", *(f for f in formats if f != "bfloat16")]:
        try:
            model = base if name == "bfloat16" else ftjax.load(policy="host", expert_dtype=name)
        except ConfigError as e:  # widths that are not whole blocks of the format
            emit("quant_ppl", model="default", expert_format=FORMATS[name], skipped=str(e))
            continue
        ppl = float(np.exp(held_out_nll(model, ids)))
        ref = ref or ppl
        emit("quant_ppl", model="default", expert_format=FORMATS[name], tokens=len(ids) - 1, perplexity=round(ppl, 4),
             vs_bf16=round(ppl / ref - 1, 6))


def best_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def kernel(threads_list: list[int], prefill_tokens: int, formats: list[str], E: int = 64) -> None:
    rng = np.random.default_rng(0)
    D, F, K = 2048, 1024, 8
    gate_up = to_bf16_bits(rng.standard_normal((1, E, 2 * F, D), np.float32) * 0.02)
    down = to_bf16_bits(rng.standard_normal((1, E, D, F), np.float32) * 0.02)
    bf16 = HostExpertPool.from_arrays(gate_up, down)
    del gate_up, down
    pools = {FORMATS[n]: bf16 if n == "bfloat16" else bf16.converted(FORMATS[n]) for n in formats}
    for threads in threads_list:
        ceiling = read_bandwidth_gbps(threads)
        for fmt, pool in pools.items():
            ex = HostExecutor(pool, threads=threads)
            x1 = rng.standard_normal((1, D)).astype(np.float32)
            calls = [rng.permutation(E)[:K][None].astype(np.int32) for _ in range(8)]
            w1 = np.full((1, K), 1 / K, np.float32)
            it = iter(range(10**9))
            s = best_s(lambda: ex.expert_ffn_numpy(x1, 0, calls[next(it) % 8], w1), 15)
            emit("quant_kernel", phase="decode", expert_format=fmt, threads=threads, d_model=D, d_ff=F, top_k=K,
                 ms=round(s * 1e3, 3), gbps=round(K * pool.expert_bytes / s / 1e9, 2),
                 read_ceiling_gbps=round(ceiling, 2))
            xp = rng.standard_normal((prefill_tokens, D)).astype(np.float32)
            ids = np.stack([rng.permutation(E)[:K] for _ in range(prefill_tokens)]).astype(np.int32)
            wp = np.full((prefill_tokens, K), 1 / K, np.float32)
            s = best_s(lambda: ex.expert_ffn_numpy(xp, 0, ids, wp), 3)
            emit("quant_kernel", phase="prefill", expert_format=fmt, threads=threads, tokens=prefill_tokens,
                 ms=round(s * 1e3, 2), tok_per_s=round(prefill_tokens / s, 1))


def whole_model(path: str, threads_list: list[int], prompt_tokens: int, new_tokens: int, formats: list[str],
                dense_dtypes: list[str]) -> None:
    rng = np.random.default_rng(1)
    if str(path).endswith(".gguf"):
        formats = [None]  # a GGUF's experts are used as stored
    for name, dense, threads in ((n, d, t) for n in formats for d in dense_dtypes for t in threads_list):
        model = ftjax.load(path, policy="host", threads=threads, expert_dtype=name,
                           dense_dtype=None if dense == "default" else dense,
                           max_seq_len=prompt_tokens + new_tokens + 64)
        vocab = model.config.vocab_size
        prompt = rng.integers(0, vocab, prompt_tokens).tolist()
        model.session().append(prompt)  # compile the prompt bucket
        prefill = []
        for _ in range(3):
            t = time.perf_counter()
            model.session().append(rng.integers(0, vocab, prompt_tokens).tolist())
            prefill.append(time.perf_counter() - t)
        model.generate(prompt[:16], 4)  # compile decode
        model.generate(prompt[:16], new_tokens)
        stats = model.last_generation
        dense_read, expert_read = decode_weight_bytes(model)
        step_bytes = dense_read + expert_read  # what one decode step reads, at least
        ceiling = read_bandwidth_gbps(threads)  # right after the decode it bounds, same threads
        emit("quant_model", model=str(path), expert_format=model.checkpoint.pool.dtype, threads=threads,
             dense_dtype=model.checkpoint.dense_dtype, dense_format=model.checkpoint.dense_format,
             dense_bytes_per_token=dense_read,
             prompt_tokens=prompt_tokens, prefill_tok_per_s=round(prompt_tokens / statistics.median(prefill), 1),
             decode_tok_per_s=round(stats.decode_tok_per_s, 2), new_tokens=stats.new_tokens,
             expert_bytes_per_token=expert_read,
             decode_read_gbps=round(step_bytes * stats.decode_tok_per_s / 1e9, 2), read_ceiling_gbps=round(ceiling, 2),
             roofline_decode_tok_per_s=round(ceiling * 1e9 / step_bytes, 1))
        del model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--skip-kernel", action="store_true")
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--model", default=None,
                    help="checkpoint folder or .gguf for the whole-model lines (e.g. the OLMoE geometry)")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--experts", type=int, default=64, help="experts in the kernel pool (default: 64)")
    ap.add_argument("--dense-dtypes", nargs="+", default=["default"],
                    help="dense storage per whole-model line: default | float32 | bfloat16 | int8 (folders)")
    add_allow_dirty_argument(ap)
    args = ap.parse_args()
    check_clean_or_exit(args.allow_dirty)
    if not args.skip_ppl:
        perplexity(args.ppl_tokens, args.formats)
    if not args.skip_kernel:
        kernel(args.threads, args.prefill_tokens, args.formats, args.experts)
    if args.model:
        whole_model(args.model, args.threads, args.prefill_tokens, args.new, args.formats, args.dense_dtypes)


if __name__ == "__main__":
    main()
