"""One process of a two-process model, for `test_distributed.py`.

    python tests/distributed_check.py COORDINATOR PROCESS_ID OUT.json [--policy lru] [--die-after-first]
        [--dying 0|1]

Joins the other process through `ftjax.distributed.connect`, loads the embedded default
model over every process's device (each process's device owns half of the experts),
generates, and writes {"tokens": [...], "stats": per-device stats}. With
--die-after-first, process 1 exits abruptly after the first generation and process 0
tries a second one: it must fail with `PeerLost` naming process 1 and exit with code 3
(`distributed.exit`). With --dying 0 it is process 0 that exits (and the coordination
service with it): process 1's second generation must end the process with code 3 and
a message naming process 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import ftjax
from ftjax import distributed

PROMPT = [11, 275, 198, 42, 7, 300, 12, 95, 61, 8]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("coordinator")
    ap.add_argument("process_id", type=int)
    ap.add_argument("out")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--die-after-first", action="store_true")
    ap.add_argument("--dying", type=int, default=1, help="with --die-after-first: which process dies")
    ap.add_argument("--timeout-s", type=float, default=30.0)
    a = ap.parse_args()
    distributed.connect(a.coordinator, 2, a.process_id, timeout_s=a.timeout_s)
    import jax

    kw = {"cache_slots": 8, "bandwidth": (1.0, 1.0)} if a.policy != "device" else {}
    model = ftjax.load(policy=a.policy, numerics="exact", devices=jax.device_count(), **kw)
    tokens = model.generate(PROMPT, 12)
    read = model.checkpoint.experts_read
    result = {"tokens": tokens, "devices": model.stats()["devices"], "process_count": jax.process_count(),
              "experts_read": None if read is None else [int(e) for e in read.nonzero()[0]]}
    if a.die_after_first:
        if a.process_id == a.dying:
            with open(a.out, "w") as f:
                json.dump(result, f)
            os._exit(9)  # abruptly: no shutdown, no goodbye
        time.sleep(2.0)
        t0 = time.monotonic()
        try:
            model.generate(PROMPT, 12)
            result["second"] = "finished"
        except distributed.PeerLost as e:
            result["second"] = f"PeerLost: {e}"
        result["second_s"] = time.monotonic() - t0
        with open(a.out, "w") as f:
            json.dump(result, f)
        print(result["second"], file=sys.stderr, flush=True)
        distributed.exit(3)
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
