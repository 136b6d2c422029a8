"""How long the engine's programs take to compile: the first prompt and the first decode
step of a freshly loaded model, per policy. A user meets this as the first request's
time to first token (per batch x token bucket), before any persistent compilation cache
holds the programs.

One JSON line per (model, policy) on stdout (commit, machine, settings, numbers):
prefill_compile_s / decode_compile_s are XLA's backend compile seconds inside the first
`Session.append` and the first decode step (jax.monitoring's compile events, so
tracing and lowering are counted apart as trace_lower_s), first_ttft_s the wall time
of that first append. The library compiles without XLA's persistent cache (the CLI turns
it on), so every line is a cold compile.

    OPENBLAS_NUM_THREADS=1 python scripts/bench_compile.py                       # default model
    OPENBLAS_NUM_THREADS=1 python scripts/bench_compile.py --model /tmp/geom-olmoe --prompt 40
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
from jax import monitoring  # noqa: E402

import ftjax  # noqa: E402
from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields  # noqa: E402,E501

BACKEND = "/jax/core/compile/backend_compile_duration"
FRONTEND = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
_seconds: dict[str, float] = defaultdict(float)
monitoring.register_event_duration_secs_listener(lambda event, secs, **_: _seconds.__setitem__(event, _seconds[event] + secs))


def _measure(fn) -> tuple[float, float, float]:
    """(backend compile s, trace + lower s, wall s) of one call."""
    _seconds.clear()
    t = time.perf_counter()
    fn()
    wall = time.perf_counter() - t
    return _seconds[BACKEND], sum(_seconds[e] for e in FRONTEND), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: the embedded model)")
    ap.add_argument("--policies", nargs="+", default=["device", "host", "lru", "lru-transfer-only"])
    ap.add_argument("--prompt", type=int, default=7, help="prompt tokens (sets the prefill bucket)")
    ap.add_argument("--threads", type=int, default=2)
    add_allow_dirty_argument(ap)
    args = ap.parse_args()
    check_clean_or_exit(args.allow_dirty)
    probe = ftjax.load(args.model)
    cfg = probe.config
    slots = max(1, cfg.num_moe_layers * cfg.num_experts // 4)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt).tolist()
    del probe
    for policy in args.policies:
        kw = {} if policy in ("device", "host") else dict(cache_slots=slots, bandwidth=(1.0, 2.0))
        model = ftjax.load(args.model, policy=policy, threads=args.threads, **kw)
        s = model.session()
        pre, pre_front, ttft = _measure(lambda: s.append(prompt))
        dec, dec_front, _ = _measure(lambda: s.generate(2))
        print(json.dumps({"bench": "compile", **commit_info(), "machine": machine_info(),
                          "model": args.model or "default", "policy": policy, "prompt_tokens": args.prompt,
                          "prefill_compile_s": round(pre, 2), "decode_compile_s": round(dec, 2),
                          "trace_lower_s": round(pre_front + dec_front, 2), "first_ttft_s": round(ttft, 2),
                          "threads": args.threads, **run_fields()}),
              flush=True)


if __name__ == "__main__":
    main()
