"""Batched decode: tok/s per session and in total for B = 1, 2, 4, 8 sessions decoding
together (`ftjax.engine.session.generate_batch`: one jitted step per token for the batch).

Each configuration: B sessions get prompts of different lengths (prefilled one by one,
not timed), one untimed round compiles the batch's decode step, then `--rounds` timed
rounds decode `--new` tokens each from fresh sessions; the decode time is the time from
the batch's first token to its last (the sessions' `last_generation.decode_s`). One JSON
line per (model, policy, B) with commit and machine fields, medians over rounds.

    python scripts/bench_batch.py [--model DIR] [--policies host lru] [--batches 1 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import ftjax  # noqa: E402
from ftjax.engine.session import generate_batch  # noqa: E402
from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields  # noqa: E402,E501


def run_batch(model, prompts: list[list[int]], new: int) -> tuple[float, int]:
    sessions = []
    for p in prompts:
        s = model.session()
        s.reserve(len(p) + new)
        s.append(p)
        sessions.append(s)
    generate_batch(sessions, new)
    decode_s = max(s.last_generation.decode_s for s in sessions)
    tokens = sum(s.last_generation.new_tokens - 1 for s in sessions)  # the first token is the prefill's
    return decode_s, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--policies", nargs="+", default=["host", "lru"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--new", type=int, default=32, help="tokens decoded per session")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache-slots", type=int, default=None, help="lru slots (default: a quarter of all experts)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--bandwidth", type=float, nargs=2, default=None, metavar=("B_P", "B_H"))
    add_allow_dirty_argument(ap)
    a = ap.parse_args(argv)
    check_clean_or_exit(a.allow_dirty)
    rng = np.random.default_rng(0)
    for policy in a.policies:
        slots = {} if policy in ("host", "device") else {"cache_slots": a.cache_slots or _quarter(a.model)}
        model = ftjax.load(a.model, policy=policy, threads=a.threads,
                           bandwidth=tuple(a.bandwidth) if a.bandwidth else None, **slots)
        V = model.config.vocab_size
        for B in a.batches:
            prompts = [rng.integers(0, V, 8 + 5 * b).tolist() for b in range(B)]
            run_batch(model, prompts, 4)  # compile the batch's steps
            runs = [run_batch(model, prompts, a.new) for _ in range(a.rounds)]
            dt = statistics.median(r[0] for r in runs)
            tokens = runs[0][1]
            line = {"bench": "batched_decode", "model": str(model.checkpoint.path.name), "policy": policy,
                    "cache_slots": model._steps.executor.slots, "batch": B, "new_tokens_per_session": a.new,
                    "total_tok_per_s": round(tokens / dt, 2), "per_session_tok_per_s": round(tokens / dt / B, 2),
                    "step_ms": round(dt / (tokens / B) * 1e3, 3), "rounds": a.rounds,
                    "decode_s_rounds": [round(r[0], 4) for r in runs], "threads": a.threads,
                    **commit_info(), **machine_info(), **run_fields()}
            print(json.dumps(line), flush=True)
    return 0


def _quarter(model_dir) -> int:
    from ftjax.config import read_config_json
    from ftjax.models import config_from_hf
    from ftjax.model import DEFAULT_MODEL_DIR

    cfg = config_from_hf(read_config_json(model_dir or DEFAULT_MODEL_DIR))
    return max(1, cfg.num_moe_layers * cfg.num_experts // 4)


if __name__ == "__main__":
    sys.exit(main())
