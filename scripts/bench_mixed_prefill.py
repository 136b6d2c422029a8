"""A long prompt prefilled beside rows that decode: what each `prefill_chunk` costs the
new request (its time to first token) and the requests already decoding (their time
between tokens while it prefills).

The scheduler prefills one chunk per iteration and runs one decode step of the other rows
after it (`ftjax/engine/scheduler.py`), so a chunk of C tokens holds every decoding row's
next token back by about C tokens of prefill. Larger chunks cost fewer steps per prompt
(less of the per-step work: a decode step of the rows, the host calls, the dispatch) and
longer gaps between the decoders' tokens. This measures both sides of that trade on the
embedded model at a declared context of --context tokens
(`ftjax.bench.models.default_model_with_context`).

Per --chunks size, warm (every program of the run compiled first), --rounds rounds: --rows
requests with short prompts start decoding (greedy, unbounded), then one --prompt-token
prompt arrives; `ttft_s` is its submit-to-first-token time, `gap_ms` the decoding rows'
inter-token gaps (p50 / p95 / max over every row) while it prefills, `decode_tokens` what
they produced meanwhile. The same prompt with no row decoding (`alone_ttft_s`: the solo
chunk rule) is the floor. Medians over the rounds, every round kept.

Prints ONE JSON line: per chunk size those numbers; commit and machine.

    OPENBLAS_NUM_THREADS=1 python scripts/bench_mixed_prefill.py [--context 16384] [--prompt 8000] [--rows 3] \
        [--chunks 256 512 1024 2048] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields  # noqa: E402,E501


def tokens(n: int, seed: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, vocab - 10, n).astype(np.int32)


def first_token_time(sched, prompt: np.ndarray) -> float:
    """Submit `prompt` for one token and step until it ends -> seconds to that token."""
    from ftjax.engine.scheduler import Job
    from ftjax.engine.session import Sampling

    first: list[float] = []
    t0 = time.perf_counter()
    job = Job(prompt, 1, Sampling(), lambda tok: first.append(time.perf_counter()) and False, lambda reason: None)
    sched.submit(job)
    while job.outcome is None:
        sched.step()
    if not first:
        raise SystemExit(f"bench_mixed_prefill: the prompt ended without a token ({job.outcome})")
    return first[0] - t0


def run_round(sched, rows: int, prompt: np.ndarray, seed: int, vocab: int) -> dict:
    """Start `rows` decoders, then time `prompt` beside them -> ttft_s, gaps (ms), tokens."""
    from ftjax.engine.scheduler import Job
    from ftjax.engine.session import Sampling

    stamps: list[list[float]] = [[] for _ in range(rows)]
    decoders = []
    for i in range(rows):
        job = Job(tokens(64, seed * 100 + i, vocab), 1 << 20, Sampling(),
                  lambda tok, s=stamps[i]: s.append(time.perf_counter()) and False, lambda reason: None,
                  banned=frozenset(sched.eos))  # they decode until cancelled
        sched.submit(job)
        decoders.append(job)
    while min(len(s) for s in stamps) < 2:  # every row decodes
        sched.step()
    t0 = time.perf_counter()
    for s in stamps:
        s.clear()
        s.append(t0)
    ttft = first_token_time(sched, prompt)
    if any(d.outcome is not None for d in decoders):
        raise SystemExit(f"bench_mixed_prefill: a decoding row ended during the prefill "
                         f"({[d.outcome for d in decoders]})")
    gaps = [1e3 * g for s in stamps for g in np.diff(s)]
    for d in decoders:
        sched.cancel(d)
    while any(d.outcome is None for d in decoders):
        sched.step()
    return {"ttft_s": ttft, "gaps_ms": gaps, "decode_tokens": sum(len(s) - 1 for s in stamps)}


def measure(a) -> list[dict]:
    import ftjax
    from ftjax.bench.models import default_model_with_context
    from ftjax.engine.scheduler import Scheduler

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        model = ftjax.load(default_model_with_context(a.context, Path(tmp) / "model"))
        vocab = model.config.vocab_size
        for chunk in a.chunks:
            sched = Scheduler(model, max_batch=a.rows + 1, prefill_chunk=chunk)
            run_round(sched, a.rows, tokens(a.prompt, 7, vocab), 0, vocab)  # compiles what the rounds run
            first_token_time(sched, tokens(a.prompt, 8, vocab))
            rounds = [run_round(sched, a.rows, tokens(a.prompt, 10 + r, vocab), r + 1, vocab) for r in range(a.rounds)]
            solo = [first_token_time(sched, tokens(a.prompt, 50 + r, vocab)) for r in range(a.rounds)]
            gaps = [g for r in rounds for g in r["gaps_ms"]]
            p50, p95 = np.percentile(gaps, [50, 95])
            out.append({"chunk": chunk, "ttft_s": round(statistics.median(r["ttft_s"] for r in rounds), 3),
                        "ttft_rounds_s": [round(r["ttft_s"], 3) for r in rounds],
                        "gap_ms": {"p50": round(float(p50), 1), "p95": round(float(p95), 1),
                                   "max": round(max(gaps), 1)},
                        "decode_tokens": [r["decode_tokens"] for r in rounds],
                        "alone_ttft_s": round(statistics.median(solo), 3),
                        "alone_rounds_s": [round(s, 3) for s in solo]})
            print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--prompt", type=int, default=8000, help="tokens of the prompt that arrives")
    ap.add_argument("--rows", type=int, default=3, help="requests decoding when it arrives")
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    add_allow_dirty_argument(ap)
    a = ap.parse_args(argv)
    check_clean_or_exit(a.allow_dirty)
    if a.prompt + 64 >= a.context:
        ap.error(f"--prompt must stay below --context {a.context}")
    if a.rows < 1 or a.rounds < 1 or min(a.chunks) < 1:
        ap.error("--rows, --rounds and every --chunks size must be positive")
    rows = measure(a)
    line = {"bench": "mixed_prefill", "model": "ftjax-default", "context": a.context, "prompt_tokens": a.prompt,
            "decoding_rows": a.rows, "rounds": a.rounds, "rows": rows,
            **commit_info(), **machine_info(), **run_fields()}
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
