"""One scheduler over several processes: process 0 decides, the others replay.

Under `jax.distributed` every process runs every step of the model (SPMD: each
process's devices hold their share of the experts, and the per-layer collectives join
them), so every process must issue the same device computations in the same order.
A server gets its requests at one process, though. The scheduler's steps are a
deterministic function of a few decisions, all made on process 0 (the leader):

    which jobs arrived since the last step (requests, idle prefills), in order
    which jobs ended by cancellation or deadline (clocks, client disconnects)
    whether idle work may start (the idle grace: a clock)
    what each job's `on_token` answered (stop strings, forced tokens, a raised error:
        the client's output parser runs on the leader only)
    that a step failed (and was recovered from)

The leader appends each decision to a log in the coordination service's key-value
store (gRPC: no shared memory, so the same code runs across machines); every other
process (a follower) runs the same `Scheduler` over mirror jobs that have no client,
and reads each decision where the leader made it. A follower also checks each token
it produced against the leader's: a divergence is an error that ends the model, never
silently different state.

    leader step n:  ─► {"k": "step", jobs, ended, idle_ok}   record r
                       {"k": "token", job, tok, answer}        record r+1, ...
    follower:       read the step decision ─► step n with it; `on_token` reads the
                    leader's answer for (job, tok)

Each decision is sent the moment it is made (one key-value write, ~0.3 ms here): JAX
runs collectives where the code does not say so (a `device_put` of host data to a
multi-process sharding checks that every process passed the same value), so a decision
held back could leave a follower waiting for it while the leader waits for the follower
in a collective. The one exception is `batched`: the answers for a decode step's rows
go out as one record, after the loop that hands out the step's tokens (which runs no
JAX computation but slicing). Records are keyed
`ftjax/replica/BLOCK/SEQ`; followers acknowledge the blocks they have read, and the
leader deletes a block once every follower has.

Failure: a follower that loses the leader (the coordination service, which runs in
process 0, stops answering) raises `PeerLost` naming process 0; the leader loses a
follower at its next collective (`distributed.step_error`) or, while idle, by polling
the live processes. A follower whose scheduler settings differ from the leader's is
refused at start-up (`handshake`), naming the setting, before any collective runs.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from ftjax import distributed

if TYPE_CHECKING:
    from ftjax.engine.scheduler import Job, Scheduler

BLOCK = 256  # records per key directory: the unit the leader deletes
DONE_GRACE_S = 0.5  # between the followers' last word and this process's end
POLL_MS = 1000  # a follower's wait for the next record, between checks that the leader is alive
_PREFIX = "ftjax/replica"


class Diverged(distributed.DistributedError):
    """A follower's state no longer matches the leader's (a token or decision differs)."""


class ReplayedError(Exception):
    """On a follower: the leader's `on_token` raised this (the same job fails the same way)."""


def _client():
    from jax._src import distributed as jax_distributed  # the client ftjax.distributed.connect made

    client = jax_distributed.global_state.client
    if client is None:
        raise distributed.DistributedError("a replicated scheduler needs ftjax.distributed.connect first")
    return client


def _key(seq: int) -> str:
    return f"{_PREFIX}/{seq // BLOCK}/{seq}"


def job_wire(job: Job) -> dict:
    """What a follower needs to build the same job (not its callbacks, deadline or client)."""
    if job.session is not None:
        raise ValueError("a job that continues a Session cannot be replicated to other processes")
    s = job.sampling
    return {"seq": job.seq, "id": job.id, "idle": job.idle, "max_new_tokens": job.max_new_tokens,
            "prompt": base64.b64encode(np.ascontiguousarray(job.prompt, "<i4").tobytes()).decode(),
            "sampling": [s.temperature, s.top_k, s.top_p, s.seed], "forced": [int(t) for t in job.forced],
            "banned": sorted(int(t) for t in job.banned),
            "logit_bias": [[int(t), float(b)] for t, b in job.logit_bias.items()]}


class Leader:
    """Process 0's side: decisions in, records out."""

    follower = False

    def __init__(self, client=None):
        import jax

        self.client = client or _client()
        self.processes = jax.process_count()
        self.seq = 0  # the next record's number
        self.deleted = 0  # blocks below this are deleted
        self.stopped = False
        self.held: list[dict] | None = None  # decisions inside `batched`

    def handshake(self, settings: dict, timeout_s: float) -> None:
        """Publish the scheduler's settings as record 0 and wait for every follower's
        verdict: a follower that differs (or does not answer) is a `DistributedError`
        naming it and the setting."""
        self.publish({"k": "settings", "settings": settings})
        for pid in range(1, self.processes):
            try:
                verdict = self.client.blocking_key_value_get(f"{_PREFIX}_ready/{pid}", int(timeout_s * 1000))
            except Exception as e:
                raise distributed.DistributedError(
                    f"process {pid} did not start its scheduler within {timeout_s:g} s "
                    f"({distributed.first_line(e)})") from e
            if verdict != "ok":
                time.sleep(DONE_GRACE_S)  # it exits after its verdict: before the coordination service goes
                raise distributed.DistributedError(f"process {pid} refused process 0's scheduler: {verdict}")

    def publish(self, decision: dict) -> None:
        """The next record (followers read them in order); inside `batched`, held for one."""
        if self.held is not None:
            self.held.append(decision)
            return
        self._send(decision)

    @contextlib.contextmanager
    def batched(self):
        """The decisions made inside go out as one record at the end: only around code
        that runs no collective (module docstring)."""
        self.held = []
        try:
            yield
        finally:
            held, self.held = self.held, None
            if held:
                self._send(held)

    def _send(self, record: dict | list[dict]) -> None:
        self.client.key_value_set(_key(self.seq), json.dumps(record, separators=(",", ":")))
        self.seq += 1
        if self.seq % BLOCK == 0:
            self._collect()

    def _collect(self) -> None:
        """Delete the blocks every follower has read."""
        acks = []
        for pid in range(1, self.processes):
            try:
                acks.append(int(self.client.key_value_try_get(f"{_PREFIX}_ack/{pid}")))
            except Exception:
                acks.append(0)  # not acknowledged yet
        done = min(acks, default=self.seq) // BLOCK
        for block in range(self.deleted, done):
            self.client.key_value_delete(f"{_PREFIX}/{block}")
        self.deleted = max(self.deleted, done)

    def recording(self, job: Job) -> None:
        """Wrap the job's `on_token` so that each answer is a decision."""
        answer_fn, seq = job.on_token, job.seq

        def on_token(tok: int):
            try:
                answer = answer_fn(tok)
            except Exception as e:
                self.publish({"k": "token", "job": seq, "tok": int(tok), "raised": f"{type(e).__name__}: {e}"})
                raise
            wire = [int(t) for t in answer] if isinstance(answer, list) else bool(answer)
            self.publish({"k": "token", "job": seq, "tok": int(tok), "answer": wire})
            return answer
        job.on_token = on_token

    def check_peers(self) -> None:
        """Raise `PeerLost` naming the processes the coordination service no longer sees."""
        gone = distributed.gone_processes()
        if gone:
            raise distributed.peer_lost(gone, "the coordination service no longer sees it")

    def stop(self, timeout_s: float = 30.0) -> None:
        """The last record (once): followers return from `follow`. Waits (up to
        `timeout_s`) for each to say it is done: the coordination service lives in this
        process, and a follower still connected when it goes is aborted by its client."""
        if self.stopped:
            return
        self.stopped = True
        self.publish({"k": "stop"})
        for pid in range(1, self.processes):
            try:
                self.client.blocking_key_value_get(f"{_PREFIX}_done/{pid}", int(timeout_s * 1000))
            except Exception:
                pass  # gone already, or slow: this process stops either way
        time.sleep(DONE_GRACE_S)  # a follower exits right after its last word: let it be gone first


class Follower:
    """A process other than 0: records in, the same steps out."""

    follower = True

    def __init__(self, client=None):
        import jax

        self.client = client or _client()
        self.pid = jax.process_index()
        self.seq = 0
        self.queued: collections.deque[dict] = collections.deque()  # read, not yet used (a batched record)
        self.jobs: dict[int, Job] = {}  # mirror jobs by the leader's seq, while alive

    def handshake(self, settings: dict, timeout_s: float) -> None:
        """Compare record 0 (the leader's settings) with ours; answer ok or the difference."""
        theirs = self.next("settings", timeout_s=timeout_s)["settings"]
        diff = [f"{k}: process 0 has {theirs.get(k)!r}, process {self.pid} has {v!r}"
                for k, v in settings.items() if theirs.get(k) != v]
        self.client.key_value_set(f"{_PREFIX}_ready/{self.pid}", "ok" if not diff else "; ".join(diff))
        if diff:
            raise distributed.DistributedError(f"process {self.pid}: the scheduler settings differ from process 0's "
                                               f"({'; '.join(diff)})")

    def next(self, kind: str | None = None, timeout_s: float | None = None) -> dict:
        """The leader's next decision (of `kind`, else `Diverged`); waits while the leader lives."""
        while not self.queued:
            record = self._read(timeout_s)
            self.queued.extend(record if isinstance(record, list) else [record])
        decision = self.queued.popleft()
        if kind is not None and decision["k"] != kind:
            raise Diverged(f"process {self.pid}: expected the leader's {kind!r} decision, got {decision['k']!r} "
                           f"(record {self.seq - 1}); this process no longer runs the leader's steps")
        return decision

    def _read(self, timeout_s: float | None) -> dict | list[dict]:
        waited = 0.0
        while True:
            try:
                record = self.client.blocking_key_value_get(_key(self.seq), POLL_MS)
                break
            except Exception as e:
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                    raise self._lost(e) from e
                waited += POLL_MS / 1000
                if timeout_s is not None and waited >= timeout_s:
                    raise distributed.DistributedError(f"process {self.pid}: process 0 sent no scheduler "
                                                       f"settings within {timeout_s:g} s") from e
                try:
                    gone = 0 in distributed.gone_processes()
                except Exception as err:
                    raise self._lost(err) from err
                if gone:
                    raise self._lost(e)
        self.seq += 1
        if self.seq % BLOCK == 0:
            self.client.key_value_set(f"{_PREFIX}_ack/{self.pid}", str(self.seq), allow_overwrite=True)
        return json.loads(record)

    def done(self) -> None:
        """After the leader's stop, the last word: the leader may now end (and the
        coordination service with it), so this process must exit right after."""
        self.client.key_value_set(f"{_PREFIX}_done/{self.pid}", "ok")

    def _lost(self, e: Exception) -> distributed.PeerLost:
        return distributed.PeerLost(f"process {self.pid}: process 0 (the leader) is gone "
                                    f"({distributed.first_line(e)}); this process cannot continue without it")

    def mirror(self, wire: dict) -> Job:
        """The leader's job, without its client: `on_token` answers what the leader's did."""
        from ftjax.engine.scheduler import Job
        from ftjax.engine.session import Sampling

        seq = wire["seq"]
        t, k, p, seed = wire["sampling"]
        job = Job(np.frombuffer(base64.b64decode(wire["prompt"]), "<i4").astype(np.int32), wire["max_new_tokens"],
                  Sampling(t, k, p, seed), self._answer(seq), self._done(seq), forced=list(wire["forced"]),
                  banned=frozenset(wire["banned"]), logit_bias={int(t): b for t, b in wire["logit_bias"]},
                  id=wire["id"], idle=wire["idle"], seq=seq)
        self.jobs[seq] = job
        return job

    def _answer(self, seq: int) -> Callable[[int], bool | list[int]]:
        def on_token(tok: int):
            d = self.next("token")
            if d["job"] != seq or d["tok"] != int(tok):
                raise Diverged(f"process {self.pid}: job {seq} produced token {tok} where process 0's job "
                               f"{d['job']} produced {d['tok']}")
            if "raised" in d:
                raise ReplayedError(d["raised"])
            return d["answer"]
        return on_token

    def _done(self, seq: int) -> Callable[[str], None]:
        return lambda reason: self.jobs.pop(seq, None)

    def follow(self, scheduler: Scheduler) -> None:
        """Run the leader's steps until its stop; raises `PeerLost` / `Diverged`."""
        while True:
            d = self.next()
            if d["k"] == "stop":
                return
            if d["k"] == "fail_all":
                scheduler._fail_all(d["reason"], None)
            elif d["k"] == "step":
                scheduler.step(d)
            else:
                raise Diverged(f"process {self.pid}: expected a step, got the leader's {d['k']!r} decision")
            if scheduler.lost is not None:
                raise scheduler.lost


def for_this_process() -> Leader | Follower | None:
    """The replica role of this process: None with one process."""
    import jax

    if not distributed.active():
        return None
    return Leader() if jax.process_index() == 0 else Follower()
