"""Expert parallelism on 1, 2 and 4 forced host devices: what each device's cache does
and what a step costs, on the embedded default model.

One child process with XLA_FLAGS=--xla_force_host_platform_device_count=4 (the devices
must exist before JAX starts) loads the model once per device count (`devices=n`, the
same --cache-slots per device, pinned bandwidths so every record's split is the same
rule), prefills a --prompt-tokens prompt and decodes --new-tokens greedily, --repeats
times on fresh sessions, and reports per device count: the decode step time (median of
the repeats' steady decode), the prefill time, the tokens (equal across counts: the
mesh changes where experts run, not what they compute), and per device its experts,
hits, fetches, host work and hit rate.

On this 2-core machine the forced devices share the same cores and RAM, so there is no
speed to gain: the step times show what the per-layer collective (an all-reduce of the
[N, D] partial outputs) and the replicated attention cost. On several GPUs the same
command with --real-devices (JAX's own devices, no forcing) measures the real thing.

Prints ONE JSON line.

    OPENBLAS_NUM_THREADS=1 python scripts/bench_mesh.py [--cache-slots 16] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields  # noqa: E402,E501

FORCED = "--xla_force_host_platform_device_count=4"


def child(a) -> dict:
    import numpy as np

    import ftjax

    runs, prompt = [], None
    for n in a.devices:
        model = ftjax.load(policy="lru", cache_slots=a.cache_slots, bandwidth=(a.b_p, a.b_h), devices=n,
                           threads=a.threads)
        if prompt is None:  # one prompt for every device count
            prompt = np.random.RandomState(0).randint(0, model.config.vocab_size, a.prompt_tokens).tolist()
        model.generate(prompt, 4)  # compile prefill and decode
        model.reset_stats()
        steps, prefills, tokens = [], [], None
        for _ in range(a.repeats):
            tokens = model.generate(prompt, a.new_tokens)
            g = model.last_generation
            steps.append(1.0 / g.decode_tok_per_s)
            prefills.append(g.ttft_s)
        runs.append({"devices": n, "decode_step_ms": round(statistics.median(steps) * 1e3, 3),
                     "prefill_s": round(statistics.median(prefills), 4), "tokens": tokens,
                     "per_device": model.stats()["devices"]})
        del model
    return {"runs": runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--cache-slots", type=int, default=16, help="per device")
    ap.add_argument("--bandwidth", type=float, nargs=2, default=(1.0, 1.0), metavar=("B_P", "B_H"))
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="host-kernel threads per device's host work")
    ap.add_argument("--real-devices", action="store_true",
                    help="use the devices JAX finds (several GPUs) instead of forced host devices")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_allow_dirty_argument(ap)
    a = ap.parse_args(argv)
    a.b_p, a.b_h = a.bandwidth
    if a.child:
        print(json.dumps(child(a)), flush=True)
        return 0
    check_clean_or_exit(a.allow_dirty)
    args = [sys.executable, __file__, "--child", "--allow-dirty", "--devices", *map(str, a.devices),
            "--cache-slots", str(a.cache_slots), "--bandwidth", str(a.b_p), str(a.b_h),
            "--prompt-tokens", str(a.prompt_tokens), "--new-tokens", str(a.new_tokens), "--repeats", str(a.repeats),
            "--threads", str(a.threads)]
    env = dict(os.environ)
    if not a.real_devices:
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FORCED}".strip()
    proc = subprocess.run(args, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-4000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = result["runs"]
    line = {"bench": "mesh", "cache_slots_per_device": a.cache_slots, "bandwidth": [a.b_p, a.b_h],
            "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens, "repeats": a.repeats,
            "forced_host_devices": not a.real_devices, "same_tokens": all(r["tokens"] == runs[0]["tokens"] for r in runs),
            "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
            **commit_info(), **machine_info(), **run_fields()}
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
