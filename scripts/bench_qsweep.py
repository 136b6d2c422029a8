"""The bandwidth split q on this machine: layer time for every q = 0..m, the profile's q*
and the q the online calibration settles on (`ftjax.bench.qsweep`).

One JSON line per (expert shape, m), with commit and machine:

    {"bench": "q_sweep", "shape": [D, F], "m": ..., "measured_ms": [layer time t(q) for q = 0..m],
     "device_path_ms" / "host_path_ms": [each half's own time at q, measured while both ran],
     "best_q": ..., "q_star": ..., "q_star_slowdown": t(q*)/t(best),
     "calibrated": {"q", "b_p_gbps", "b_h_gbps", "slowdown"}, "within_10pct": ...}

    OPENBLAS_NUM_THREADS=1 python scripts/bench_qsweep.py [--shape 2048 768] [--misses 8 16] [--repeats 15]

Default shape: Qwen3-30B-A3B's experts (D 2048, F 768), bf16, m = 8 and 16 (one and two
tokens' worth of top-8 misses). The profile (B_P, B_H) is measured first, as `load` does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftjax.bench.paper import this_machine  # noqa: E402
from ftjax.bench.qsweep import measure_shape  # noqa: E402
from ftjax.experts.profile import measure  # noqa: E402
from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields  # noqa: E402,E501


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=2, default=(2048, 768), metavar=("D", "F"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--misses", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    add_allow_dirty_argument(ap)
    args = ap.parse_args()
    check_clean_or_exit(args.allow_dirty)
    d, f = args.shape
    profile = measure((d, f), args.dtype, args.threads, top_k=8)
    hw = this_machine(profile)
    shape = measure_shape("bench", d, f, args.dtype, args.misses, hw, {}, args.threads, args.repeats,
                          log=lambda msg: print(msg, file=sys.stderr, flush=True))
    for sw in shape["sweeps"]:
        cal = sw["calibrated"]
        print(json.dumps({
            "bench": "q_sweep", **commit_info(), "machine": machine_info(), "shape": [d, f], "dtype": args.dtype,
            "m": sw["m"], "repeats": args.repeats, "profile_gbps": {"B_P": hw.b_p_gbps, "B_H": hw.b_h_gbps},
            "measured_ms": [round(t * 1e3, 4) for t in sw["measured_s"]],
            "device_path_ms": [round(t * 1e3, 4) for t in sw["device_path_s"]],
            "host_path_ms": [round(t * 1e3, 4) for t in sw["host_path_s"]], "best_q": sw["measured_best_q"],
            "q_star": sw["q_star"], "q_star_slowdown": round(sw["q_star_slowdown"], 4),
            "calibrated": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in cal.items()},
            "within_10pct": cal["slowdown"] <= 1.10, "threads": args.threads, **run_fields()}), flush=True)


if __name__ == "__main__":
    main()
