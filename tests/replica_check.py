"""A leader and a follower scheduler in one process, for `test_distributed.py`.

    python tests/replica_check.py COORDINATOR_PORT OUT.json

`engine.replica` without a second process: one process joins `jax.distributed` alone
(the real coordination service and its key-value store), and two `Scheduler`s share
the embedded model: the leader's steps publish their decisions, the follower runs the
same steps from them (`Follower.follow`, one record at a time, interleaved on this
thread: with one process no step waits on the other). Every path that decides
something is exercised: a stop answer, forced tokens, a raising `on_token`, a
cancellation, a deadline, idle prefills (admitted, preempted) and a drain. The
follower checks every token against the leader's; OUT.json gets both schedulers'
counters and each job's tokens.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from ftjax import distributed


def main() -> int:
    port, out = sys.argv[1], sys.argv[2]
    distributed.connect(f"127.0.0.1:{port}", 1, 0, timeout_s=30)
    import ftjax
    from ftjax.engine import replica
    from ftjax.engine.scheduler import Job, Scheduler
    from ftjax.engine.session import Sampling
    from ftjax.engine.state_cache import StateCache

    model = ftjax.load(policy="lru", numerics="exact", cache_slots=8, bandwidth=(1.0, 1.0))
    leader, follower = replica.Leader(), replica.Follower()
    lead = Scheduler(model, 2, 64, StateCache(model, "prefix"), replica=leader)
    follow = Scheduler(model, 2, 64, StateCache(model, "prefix"), replica=follower)
    leader.handshake({"max_batch": 2}, 10)  # no other process to wait for
    follower.handshake({"max_batch": 2}, 10)
    lead.idle_grace_s = 0.0

    tokens: dict[str, list[int]] = {}
    outcomes: dict[str, str] = {}
    rng = np.random.default_rng(0)

    def job(name: str, n: int, on_token=None, **kw) -> Job:
        toks = tokens.setdefault(name, [])

        def record(tok):
            toks.append(tok)
            return on_token(tok) if on_token else False
        return Job(rng.integers(3, 500, size=int(rng.integers(5, 150))).astype(np.int32), n, kw.pop("sampling", Sampling()),
                   record, lambda reason: outcomes.__setitem__(name, reason), id=name, **kw)

    def raises(tok):
        if len(tokens["raises"]) == 3:
            raise RuntimeError("the client's parser broke")
        return False

    cancel_me = job("cancelled", 400)
    jobs = [job("plain", 12), job("stop", 40, on_token=lambda tok: len(tokens["stop"]) == 5),
            job("forced", 10, on_token=lambda tok: [7, 8, 9] if len(tokens["forced"]) == 2 else False),
            job("raises", 20, on_token=raises), job("sampled", 15, sampling=Sampling(0.8, 20, 0.9, 7)), cancel_me,
            job("deadline", 400, deadline=time.monotonic() + 3.0), job("banned", 8, banned=frozenset({11, 12}))]

    def run_steps(until, limit=2000):
        for _ in range(limit):
            if until():
                return
            lead.step()
            while follower.seq < leader.seq:  # the follower catches up, record by record
                d = follower.next()
                if d["k"] == "step":
                    follow.step(d)
                elif d["k"] == "fail_all":
                    follow._fail_all(d["reason"], None)
                assert follow.lost is None, follow.lost
        raise RuntimeError("the scheduler did not get there")

    for j in jobs[:4]:
        lead.submit(j)
    run_steps(lambda: len(tokens.get("plain", [])) >= 4)
    for j in jobs[4:]:
        lead.submit(j)
    run_steps(lambda: len(tokens.get("cancelled", [])) >= 6)
    lead.cancel(cancel_me)
    run_steps(lambda: not lead.busy())
    lead.submit_idle(np.arange(3, 300, dtype=np.int32))  # admitted and finished
    run_steps(lambda: lead.stats()["idle"]["done"] == 1)
    lead.submit_idle(np.arange(5, 900, dtype=np.int32))
    run_steps(lambda: lead.stats()["idle"]["admitted"] == 2)
    lead.submit(job("after idle", 6))  # preempts the idle prefill
    run_steps(lambda: not lead.busy())
    lead.submit_idle(np.arange(9, 100, dtype=np.int32))
    lead.drain()  # the idle job waiting is dropped on both
    run_steps(lambda: not lead.busy())
    leader.stop()
    follower.follow(follow)  # reads the stop record and returns
    alive = len(follower.jobs)
    leader.stopped = False  # a token the follower did not produce: it must refuse to go on
    leader.publish({"k": "token", "job": 99, "tok": 5, "answer": False})
    try:
        follower._answer(99)(6)
        diverged = "not detected"
    except replica.Diverged as e:
        diverged = str(e)

    keep = ("steps", "admitted", "finished", "cancelled", "timeouts", "errors", "peak_active", "idle")
    with open(out, "w") as f:
        json.dump({"tokens": tokens, "outcomes": outcomes, "leader": {k: lead.stats()[k] for k in keep},
                   "follower": {k: follow.stats()[k] for k in keep}, "follower_jobs_alive": alive,
                   "diverged": diverged,
                   "records": leader.seq, "cache": [lead.state_cache.counters, follow.state_cache.counters]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
