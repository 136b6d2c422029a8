"""Decode against llama.cpp in alternating short turns: one ftjax process and llama-bench
take turns on the same GGUF, round after round, so both see the same moments of a noisy
machine.

Why: on a shared VM the memory bandwidth a decode step reads at swings by a third within
minutes (the read probe of scripts/bench_quant.py: 31-55 GB/s at 2 threads in one run),
and a benchmark that runs one engine's whole measurement, then the other's, compares two
different machines. Here each round is ftjax's --new greedy tokens (a model loaded once,
warm) followed at once by `llama-bench -p 0 -n NEW -r 1 --repack 0` (its tg: tokens one by
one from an empty context); the ratio of each round's pair is what the machine's state
cannot move.

Lines: per round one `quant_model` line (ftjax: decode_tok_per_s, the fields bench_quant
writes for decode) and one `decode_llamacpp` line (tok_per_s), both with prompt_tokens 0
and "paired": round number, so scripts/results.py's decode tables take them as they take
bench_quant / bench_llamacpp runs; then a `decode_paired_summary` line per thread count
(medians, and the median of the per-round ratios).

    OPENBLAS_NUM_THREADS=1 python scripts/bench_decode_paired.py --gguf /tmp/olmoe4-q4_k_m.gguf \\
        --llama-bench /tmp/llbench/bin/llama-bench --threads 1 2 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import statistics

import ftjax
from bench_llamacpp import run_llama_bench
from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields

FIRST_TOKEN = 5  # the one-token context ftjax decodes from (llama-bench's tg starts from none)


def llama_tg(binary: str, gguf: str, new: int, threads: int) -> float:
    """tok/s of one llama-bench tg run from an empty context (bench_llamacpp.run_llama_bench:
    -p 0 -n new -r 1, --repack 0)."""
    tests = run_llama_bench(binary, gguf, [0], new, threads, 1)
    tg = next((t for t in tests if t["n_gen"] == new and t["n_prompt"] == 0), None)
    if tg is None:
        raise SystemExit(f"llama-bench printed no tg{new} result: {tests}")
    return float(tg["avg_ts"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--llama-bench", required=True, help="llama-bench binary built from llama.cpp's sources")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--new", type=int, default=32)
    add_allow_dirty_argument(p)
    args = p.parse_args()
    check_clean_or_exit(args.allow_dirty)
    common = {**commit_info(), "machine": machine_info(), **run_fields()}

    def emit(**fields):
        print(json.dumps({**fields, **common}), flush=True)

    for threads in args.threads:
        model = ftjax.load(args.gguf, policy="host", threads=threads, max_seq_len=args.new + 64)
        model.generate([FIRST_TOKEN], 4)  # compile the decode step
        ours, theirs = [], []
        for r in range(args.rounds):
            model.generate([FIRST_TOKEN], args.new)
            ours.append(model.last_generation.decode_tok_per_s)
            emit(bench="quant_model", model=args.gguf, expert_format=model.checkpoint.pool.dtype, threads=threads,
                 prompt_tokens=0, new_tokens=args.new, decode_tok_per_s=round(ours[-1], 2), paired=r + 1)
            theirs.append(llama_tg(args.llama_bench, args.gguf, args.new, threads))
            emit(bench="decode_llamacpp", gguf=args.gguf, threads=threads, prompt_tokens=0, new_tokens=args.new,
                 tok_per_s=round(theirs[-1], 2), paired=r + 1)
        del model
        ratios = [a / b for a, b in zip(ours, theirs)]
        emit(bench="decode_paired_summary", gguf=args.gguf, threads=threads, rounds=args.rounds,
             ftjax_tok_per_s=round(statistics.median(ours), 2), llamacpp_tok_per_s=round(statistics.median(theirs), 2),
             median_round_ratio=round(statistics.median(ratios), 3), round_ratios=[round(x, 3) for x in ratios])


if __name__ == "__main__":
    main()
