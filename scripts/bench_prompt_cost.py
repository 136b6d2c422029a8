"""Prompt cost against prompt length: does prefill time follow the real token count, and
what do compilation and a restart add?

The default model's weights at a declared context of --context tokens
(`ftjax.bench.models.default_model_with_context`), random prompts of each --lengths
(defaults straddle power-of-two boundaries: 1,000 / 1,100, 3,945 / 4,169, ...), each
prefilled into a new session. Three child processes, each on its own, one after the
other:
  cold      an empty compilation-cache folder: `first_s` includes compiling
  restart   a new process on the folder `cold` filled: what a restarted server pays
  pow2      the previous rule, one call per `prefill_chunk` padded to a power of two
            (ftjax.engine.session.prefill_pieces replaced), warm, for comparison
In each, after the first call, --repeats more calls give `warm_s` (median).

Prints ONE JSON line: per length the pieces and padded tokens of both rules, first /
warm / restart seconds and warm tokens per second; `neighbours`: for each pair of
lengths less than 15% apart (1,000 / 1,100, ...), the warm seconds per token of the
longer over the shorter, for the pieces rule and for pow2 (1.0: cost follows the tokens;
attention's growth with context alone adds a few percent), and the largest of them;
commit and machine.

With `--llama-bench BIN --gguf FILE`, llama.cpp's own llama-bench (`--repack 0`, its
AVX-512 path; as many threads as ftjax has cores) prefills the same lengths from an empty
context on the same weights, --repeats rounds after its warm-up run, and each row gets
`llamacpp_s` (the median round) and its rounds. The GGUF: the default model's weights
at the context, converted by llama.cpp's converter (`bench_llamacpp.py --convert` on a
folder holding the context's config.json and the model.safetensors: no tokenizer files,
so it writes the "none" vocabulary; llama-bench feeds random ids).

    OPENBLAS_NUM_THREADS=1 python scripts/bench_prompt_cost.py [--context 16384] [--lengths ...] [--repeats 3] \
        [--llama-bench /tmp/llbench/bin/llama-bench --gguf /tmp/dm16k-bf16.gguf]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_llamacpp import run_llama_bench  # noqa: E402  (this folder: the script's own)
from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields  # noqa: E402,E501

LENGTHS = [1000, 1100, 2000, 2100, 3945, 4169, 7900, 8300, 15000]


def pow2_pieces(n: int, chunk: int) -> list[int]:
    """The previous rule: calls of `chunk` tokens, the last padded to a power of two."""
    return [min(chunk, n - i) for i in range(0, n, chunk)]


def child(a) -> dict:
    import numpy as np

    import ftjax
    from ftjax.bench.models import default_model_with_context
    from ftjax.engine import session as session_module
    from ftjax.engine.shapes import bucket, prefill_pieces

    if a.rule == "pow2":
        session_module.prefill_pieces = pow2_pieces
    rule = pow2_pieces if a.rule == "pow2" else prefill_pieces
    with tempfile.TemporaryDirectory() as tmp:
        model = ftjax.load(default_model_with_context(a.context, Path(tmp) / "model"))
        rng = np.random.default_rng(0)
        rows = []
        for n in a.lengths:
            ids = rng.integers(0, model.config.vocab_size, n).astype(np.int32)
            times = []
            for _ in range(1 + a.repeats):
                s = model.session()
                t0 = time.perf_counter()
                s.append(ids)
                times.append(time.perf_counter() - t0)
                s.close()
            pieces = rule(n, model.prefill_chunk)
            rows.append({"tokens": n, "pieces": pieces, "padded": sum(pieces[:-1]) + bucket(pieces[-1]),
                         "first_s": round(times[0], 4), "warm_s": round(statistics.median(times[1:]), 4)})
    return {"rows": rows, "prefill_chunk": model.prefill_chunk}


def run_child(a, rule: str, cache: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--rule", rule, "--context", str(a.context), "--repeats",
           str(a.repeats), "--lengths", *map(str, a.lengths)]
    out = subprocess.run(cmd, env={**os.environ, "FTJAX_COMPILE_CACHE": cache}, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{rule} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_bench_seconds(binary: str, gguf: str, lengths: list[int], repeats: int) -> dict[int, list[float]]:
    """llama-bench's prompt seconds per length: {tokens: [seconds per round]}."""
    tests = run_llama_bench(binary, gguf, lengths, 0, len(os.sched_getaffinity(0)), repeats)
    return {t["n_prompt"]: [round(ns / 1e9, 4) for ns in t["samples_ns"]] for t in tests if t["n_gen"] == 0}


def neighbours(rows: list[dict], key: str) -> list[dict]:
    """Seconds per token of each length over its shorter neighbour's, for lengths < 15% apart."""
    rows = sorted(rows, key=lambda r: r["tokens"])
    return [{"tokens": [a["tokens"], b["tokens"]],
             "per_token_ratio": round((b[key] / b["tokens"]) / (a[key] / a["tokens"]), 3)}
            for a, b in zip(rows, rows[1:]) if b["tokens"] < 1.15 * a["tokens"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary: time the same lengths")
    ap.add_argument("--gguf", default=None, help="the default model's weights as a GGUF (with --llama-bench)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rule", choices=["pieces", "pow2"], default="pieces", help=argparse.SUPPRESS)
    add_allow_dirty_argument(ap)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a)))
        return 0
    check_clean_or_exit(a.allow_dirty)
    if max(a.lengths) >= a.context:
        ap.error(f"--lengths must stay below --context {a.context}")
    if (a.llama_bench is None) != (a.gguf is None):
        ap.error("--llama-bench and --gguf go together")
    with tempfile.TemporaryDirectory() as cache:
        cold = run_child(a, "pieces", cache)
        restart = run_child(a, "pieces", cache)
    with tempfile.TemporaryDirectory() as cache:
        pow2 = run_child(a, "pow2", cache)
    llama = llama_bench_seconds(a.llama_bench, a.gguf, a.lengths, a.repeats) if a.llama_bench else {}
    rows = []
    for c, r, p in zip(cold["rows"], restart["rows"], pow2["rows"]):
        rows.append({"tokens": c["tokens"], "pieces": c["pieces"], "padded": c["padded"], "first_s": c["first_s"],
                     "warm_s": c["warm_s"], "restart_first_s": r["first_s"],
                     "warm_tok_per_s": round(c["tokens"] / c["warm_s"], 1), "pow2_pieces": p["pieces"],
                     "pow2_padded": p["padded"], "pow2_warm_s": p["warm_s"]})
        if c["tokens"] in llama:
            rounds = llama[c["tokens"]]
            rows[-1] |= {"llamacpp_s": sorted(rounds)[(len(rounds) - 1) // 2], "llamacpp_rounds_s": rounds}
    line = {"bench": "prompt_cost", "model": "ftjax-default", "context": a.context,
            "prefill_chunk": cold["prefill_chunk"], "repeats": a.repeats, "rows": rows,
            "neighbours": neighbours(rows, "warm_s"), "pow2_neighbours": neighbours(rows, "pow2_warm_s"),
            "max_neighbour_ratio": max((n["per_token_ratio"] for n in neighbours(rows, "warm_s")), default=None),
            "pow2_max_neighbour_ratio": max((n["per_token_ratio"] for n in neighbours(rows, "pow2_warm_s")),
                                            default=None),
            "llamacpp": {"llama_bench": a.llama_bench, "gguf": a.gguf, "threads": len(os.sched_getaffinity(0)),
                         "repack": 0} if a.llama_bench else None,
            "first_s_total": round(sum(r["first_s"] for r in rows), 2),
            "restart_first_s_total": round(sum(r["restart_first_s"] for r in rows), 2),
            **commit_info(), **machine_info(), **run_fields()}
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
