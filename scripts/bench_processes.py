"""Several processes, one model: what each process holds, and what a decode step costs.

Runs the model once in one process and once over --processes processes on localhost
(`ftjax.distributed`, gloo collectives, one CPU device each: each process reads only
the experts its device owns), on the same checkpoint, and reports per run: each
process's resident memory after load (peak RSS) and the routed-expert bytes its pool
holds, the load time, the prefill time of a --prompt-tokens prompt, the decode rate
over --new-tokens greedy tokens, and whether the tokens equal the one-process run's.

On this 2-core machine the processes share the cores and the RAM, so the step times
show what the per-layer all-reduce between processes costs, not a speed-up; the memory
column is the point: the pool is split, not copied.

Prints ONE JSON line.

    OPENBLAS_NUM_THREADS=1 python scripts/bench_processes.py --model /tmp/olmoe4 [--processes 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields  # noqa: E402,E501


def child(a) -> None:
    """One process of a run: join, load, prefill, decode; one JSON line on stdout."""
    import numpy as np

    if a.num_processes > 1:
        from ftjax import distributed

        distributed.connect(a.coordinator, a.num_processes, a.process_id, timeout_s=120)
    import jax

    import ftjax

    t0 = time.perf_counter()
    model = ftjax.load(a.model, policy="lru", cache_slots=a.cache_slots, bandwidth=(1.0, 1.0), threads=a.threads,
                       devices=jax.device_count() if a.num_processes > 1 else None)
    load_s = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    prompt = np.random.RandomState(0).randint(3, model.config.vocab_size, size=a.prompt_tokens).tolist()
    model.generate(prompt[:16], 4)  # compile
    session = model.session()
    t0 = time.perf_counter()
    session.append(prompt)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = session.generate(a.new_tokens)
    decode_s = time.perf_counter() - t0
    read = model.checkpoint.experts_read
    pool = model.checkpoint.pool
    experts = pool.num_experts if read is None else int(read.sum())
    print(json.dumps({"process": a.process_id, "peak_rss_bytes": rss, "load_s": round(load_s, 2),
                      "pool_bytes_read": experts * pool.num_layers * pool.expert_bytes,
                      "pool_bytes": pool.total_bytes, "prefill_s": round(prefill_s, 3),
                      "decode_tok_s": round(a.new_tokens / decode_s, 2), "tokens": tokens}), flush=True)
    if a.num_processes > 1:
        from ftjax import distributed

        distributed.exit(0)  # without JAX's exit-time barrier


def run(a, n: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, __file__, "--child", "--model", a.model, "--coordinator",
                               f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i),
                               "--cache-slots", str(a.cache_slots), "--prompt-tokens", str(a.prompt_tokens),
                               "--new-tokens", str(a.new_tokens), "--threads", str(a.threads)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"a process failed:\n{err[-3000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint folder (e.g. scripts/make_geometry_checkpoint.py)")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--cache-slots", type=int, default=16, help="device expert-cache slots per device")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="host expert threads per process")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", help=argparse.SUPPRESS)
    ap.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    add_allow_dirty_argument(ap)
    a = ap.parse_args()
    if a.child:
        return child(a)
    check_clean_or_exit(a.allow_dirty)
    runs = {1: run(a, 1), a.processes: run(a, a.processes)}
    want = runs[1][0]["tokens"]
    line = {"bench": "processes", "model": a.model, "cache_slots": a.cache_slots, "threads": a.threads,
            "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
            "runs": {str(n): {"processes": [{k: v for k, v in r.items() if k != "tokens"} for r in rs],
                              "tokens_equal": all(r["tokens"] == want for r in rs)} for n, rs in runs.items()},
            **commit_info(), **machine_info(), **run_fields()}
    print(json.dumps(line))


if __name__ == "__main__":
    main()
