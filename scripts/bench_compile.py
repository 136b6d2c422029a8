"""How long the engine's programs take to compile: the first prompt and the first decode
step of a freshly loaded model, per policy, and the same again once the programs are in
the persistent compilation cache. A user meets the first as the first request's time to
first token (per batch x token bucket) in a process that never ran the model; the
second as a restarted server's.

One JSON line per (model, layers, policy) on stdout (commit, machine, settings, numbers):
prefill_compile_s / decode_compile_s are XLA's backend compile seconds inside the first
`Session.append` and the first decode step (jax.monitoring's compile events, so
tracing and lowering are counted apart as trace_lower_s), first_ttft_s the wall time
of that first append (cold_read_s: the cache reads among them). The benchmark gives
JAX an empty cache folder of its own (a folder the user's earlier runs filled would turn
compiles into reads), so these are cold compiles; then a new process (a restarted server) loads the same checkpoint and
reads them back: restart_ttft_s / restart_decode_s (first append / first two decode
tokens) and restart_trace_lower_s / restart_read_s (cache_retrieval_time_sec). The
folder serves the whole run, so a later line's cold numbers read back the few small
programs every policy shares (a new state, the first token's sampling).

--layers N (any number of them): the default model made N layers deep
(`ftjax.bench.models.default_model_with_layers`): how compile time grows with depth.

    OPENBLAS_NUM_THREADS=1 python scripts/bench_compile.py                       # default model
    OPENBLAS_NUM_THREADS=1 python scripts/bench_compile.py --layers 6 24 48 --prompt 2000 --policies device lru
    OPENBLAS_NUM_THREADS=1 python scripts/bench_compile.py --model /tmp/geom-olmoe --prompt 40
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
from jax import monitoring  # noqa: E402

import ftjax  # noqa: E402
from ftjax.bench.models import default_model_with_layers  # noqa: E402
from ftjax.compilation import use_folder  # noqa: E402
from ftjax.model import DEFAULT_MODEL_DIR  # noqa: E402
from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields  # noqa: E402,E501

BACKEND = "/jax/core/compile/backend_compile_duration"
FRONTEND = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
READ = "/jax/compilation_cache/cache_retrieval_time_sec"
_seconds: dict[str, float] = defaultdict(float)
monitoring.register_event_duration_secs_listener(lambda event, secs, **_: _seconds.__setitem__(event, _seconds[event] + secs))


def _measure(fn) -> tuple[float, float, float, float]:
    """(backend compile s, trace + lower s, cache read s, wall s) of one call."""
    _seconds.clear()
    t = time.perf_counter()
    fn()
    wall = time.perf_counter() - t
    return _seconds[BACKEND], sum(_seconds[e] for e in FRONTEND), _seconds[READ], wall


def first_calls(path, policy: str, prompt: list[int], threads: int, slots: int) -> dict:
    """A new model of `path`: its first prompt and first decode tokens, measured. Models
    of earlier calls are collected first: their host pools' registered ids go back, and
    this model's programs hold the id a new process's first model gets (the lowest)."""
    gc.collect()
    kw = {} if policy in ("device", "host") else dict(cache_slots=slots, bandwidth=(1.0, 2.0))
    model = ftjax.load(path, policy=policy, threads=threads, **kw)
    s = model.session()
    pre, pre_front, pre_read, ttft = _measure(lambda: s.append(prompt))
    dec, dec_front, dec_read, dec_wall = _measure(lambda: s.generate(2))
    s.close()
    return {"compile": (pre, dec), "front": pre_front + dec_front, "read": pre_read + dec_read,
            "ttft": ttft, "decode": dec_wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: the embedded model)")
    ap.add_argument("--policies", nargs="+", default=["device", "host", "lru", "lru-transfer-only"])
    ap.add_argument("--prompt", type=int, default=7, help="prompt tokens (sets the prefill bucket)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, nargs="+", default=None,
                    help="the default model made this many layers deep (each a new line); not with --model")
    ap.add_argument("--child", nargs=4, metavar=("PATH", "POLICY", "SLOTS", "VOCAB"), help=argparse.SUPPRESS)
    add_allow_dirty_argument(ap)
    args = ap.parse_args()
    if args.child:  # the restarted process: the cache folder comes in FTJAX_COMPILE_CACHE
        path, policy, slots, vocab = args.child
        prompt = np.random.default_rng(0).integers(0, int(vocab), args.prompt).tolist()
        print(json.dumps(first_calls(path, policy, prompt, args.threads, int(slots))))
        return
    check_clean_or_exit(args.allow_dirty)
    with tempfile.TemporaryDirectory() as tmp:
        folder = use_folder(Path(tmp) / "xla")  # cold: no program of an earlier run
        for layers in args.layers or [None]:
            path = args.model if layers is None else default_model_with_layers(layers, Path(tmp) / f"L{layers}")
            run(args, str(path or DEFAULT_MODEL_DIR), layers, folder)


def restarted(args, path: str, policy: str, slots: int, vocab: int, folder: str) -> dict:
    """first_calls in a new process reading `folder`."""
    cmd = [sys.executable, __file__, "--child", path, policy, str(slots), str(vocab), "--prompt", str(args.prompt),
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, env={**os.environ, "FTJAX_COMPILE_CACHE": folder}, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the restarted process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args, path: str, layers: int | None, folder: str) -> None:
    probe = ftjax.load(path)
    cfg = probe.config
    slots = max(1, cfg.num_moe_layers * cfg.num_experts // 4)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt).tolist()
    del probe
    for policy in args.policies:
        cold = first_calls(path, policy, prompt, args.threads, slots)
        restart = restarted(args, path, policy, slots, cfg.vocab_size, folder)
        pre, dec = cold["compile"]
        print(json.dumps({"bench": "compile", **commit_info(), "machine": machine_info(),
                          "model": args.model or "default", "layers": layers or cfg.num_layers, "policy": policy,
                          "prompt_tokens": args.prompt, "prefill_compile_s": round(pre, 2),
                          "decode_compile_s": round(dec, 2), "trace_lower_s": round(cold["front"], 2),
                          "first_ttft_s": round(cold["ttft"], 2), "cold_read_s": round(cold["read"], 3),
                          "restart_ttft_s": round(restart["ttft"], 2),
                          "restart_decode_s": round(restart["decode"], 2),
                          "restart_trace_lower_s": round(restart["front"], 2),
                          "restart_read_s": round(restart["read"], 2),
                          "restart_compile_s": round(sum(restart["compile"]), 2),
                          "threads": args.threads, **run_fields()}),
              flush=True)


if __name__ == "__main__":
    main()
