"""Continuous batching: requests join and leave one batched decode step while it runs.

The `Scheduler` is the one decode loop: the server's requests and the Python API's
generations (`Session.generate`, `generate_batch`, `Model.generate*`) all decode here.
It keeps ONE batched state and advances it one token per iteration, admitting new
requests between steps.

    submit(job) ─► queue ─► prefill, one chunk of `prefill_chunk` tokens per iteration
                            (a batch-1 Session; a long prompt never stalls the others'
                            decode for more than one chunk), or of `solo_chunk` while
                            no row decodes (nobody waits on the step; small chunks cost
                            the embedded model 1.4x the time of 2,048-token ones)
                         ─► first token from the prefill's logits ─► joins a free row
    rows [Bp] ─► one jitted decode step per iteration (Steps.decode: per-row token,
                 position, active mask, key, counter, sampling) ─► each row's token to
                 its job's `on_token`; finished / cancelled rows leave at once

Shapes stay in a small set so the programs compile a bounded number of times: the
batch Bp is padded to a power of two (at most `max_batch`), the capacity S of the
batched state and of a prefilling session to MIN_CAPACITY x 4^i (at most the model's
context; attention reads only the keys in use, so a larger S costs memory, not time),
a prefill chunk to a power of two. Capacity follows the tokens actually held, not
`max_new_tokens`: the batched state grows to the next bucket when a row reaches its
end, and shrinks (rows and capacity) to the smallest buckets that hold the live rows
when rows leave, so one request asking for the whole context does not size every row.
`warmup()` compiles every shape up front.

A row samples exactly as a lone `Session.generate` would: token 0 from the prefill
logits with fold_in(PRNGKey(seed), 0), token i with counter i; so greedy and seeded
output does not depend on who else is in the batch. Two per-row controls serve
constrained output: `forced` tokens (given up front, or returned by `on_token` along
the way) are emitted and fed before any sampled one, and a per-row logit bias (`banned`
tokens at -inf, OpenAI's `logit_bias`) is added inside the jitted step before sampling.

A job either starts from a prompt (a new session, or the state cache's best match) or
continues a `Session` (`Job.session`: the Python API; the session holds the prompt and
its next-token logits). A session's row goes back to its session when the job ends,
the last emitted token pending, as `Session.generate` leaves it; if a failed step took
the state with it, the session keeps its tokens and re-prefills them on its next call.

Every job ends exactly once. A job is tracked from the moment it leaves the queue (as
the prefill) until it leaves the batch, and `_finish` is the only way out: eos | stop |
length | context | cancelled | timeout (its `deadline` passed) | error: .... A failed
prefill (restore, chunk, join) fails that job alone; a failed decode step fails the
rows of the batch (their donated state is gone). Either way the expert-cache state is
rebuilt if the failure consumed it (`Model.recover`), the failure is logged with the
job ids, and the loop goes on serving; if recovery itself fails the scheduler is
`degraded` (with the reason) and refuses new work until a later recovery succeeds.

Bounded: the queue holds at most `max_queue` jobs (`submit` raises `QueueFull`);
`drain()` stops admitting (`NotAccepting`), and `fail_pending(reason)` ends everything
still queued or running, for a shutdown whose deadline has passed.

Threading: `run()` is the engine loop on one thread (JAX calls are blocking);
`submit` / `cancel` / `stats` / `drain` / `fail_pending` may be called from any thread. A cancelled job leaves
within one iteration (at most one prefill chunk plus one decode step) and its state
is dropped. What other threads do reaches a step only through `_sync`, at its start:
submitted jobs wait in an inbox until then, and cancellations, deadlines and the idle
grace are read there once. So a step is a function of the scheduler's state and that
one decision, which is what lets several processes run one scheduler
(`engine.replica`: process 0 makes the decision, the others replay it).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ftjax import distributed
from ftjax.engine import replica
from ftjax.engine.memory import DeviceMemoryError, consumed, tree_bytes
from ftjax.engine.sampling import bias_arrays, greedy_token, key_data
from ftjax.engine.session import Sampling, _first_tokens
from ftjax.engine.shapes import MIN_CAPACITY, bucket
from ftjax.models.common import resize_state

if TYPE_CHECKING:
    from ftjax.engine.session import Session
    from ftjax.model import Model

log = logging.getLogger("ftjax.engine")
IDLE_JOBS = 4  # idle prefills waiting at most (`Scheduler.submit_idle`): the newest win
# Idle work starts only after this long with no request queued, prefilling or decoding:
# under load an agent's next request follows its response within milliseconds, so rows
# that free up between requests are not idle (measured: without it, 1 idle prefill a
# 43-request load run slipped into such a gap and was preempted); a tool running for
# seconds loses 50 ms of idle time.
IDLE_GRACE_S = 0.05
# A request's prefill chunk while no row decodes (at most the model's `prefill_chunk`, at
# least the scheduler's): the embedded model at 16k prefilled 9,000 tokens in 1.71-1.77 s
# in chunks of 256, 1.34-1.43 in 1,024, 1.27-1.28 in 2,048 and 1.24-1.26 in 4,096 (warm, a
# 2-core Zen 4). A chunk is one step: a cancellation or deadline acts after it.
SOLO_PREFILL_CHUNK = 2048
# A request's prefill chunk beside decoding rows (`--prefill-chunk`): each chunk holds the
# rows' next token back by its own time. On the embedded model at 16k (2-core Zen 4), an
# 8,000-token prompt beside 3 decoding rows: chunks of 256 -> its TTFT 1.66x its lone time,
# the rows' tokens 68 ms apart (p50); 512 -> 1.22x, 110 ms (`scripts/bench_mixed_prefill.py`).
# Under agent load (`bench_soak.py --long`, back to back) 512 cut agent TTFT p50 / p95
# 18.7 / 23.3 s -> 14.6 / 20.6 s; short requests 129 -> 118 ms p50.
DEFAULT_PREFILL_CHUNK = 512
DEFAULT_MAX_QUEUE = 64
PEER_CHECK_S = 2.0  # several processes, idle: how often the engine checks that its peers are there


class QueueFull(Exception):
    """The queue holds `max_queue` jobs: come back later."""


class NotAccepting(Exception):
    """The scheduler takes no new work (draining for shutdown, or degraded)."""


@dataclass(eq=False)
class Job:
    """One request's generation. `on_token(tok)` returns True to stop it (e.g. a stop
    string), or a list of tokens to force next (e.g. closing a reasoning budget);
    `on_done(reason)` is called exactly once: eos | stop | length | context | cancelled |
    timeout | error: ... Both are called on the engine thread and must not block."""

    prompt: np.ndarray  # [T] int32, checked by the caller
    max_new_tokens: int
    sampling: Sampling
    on_token: Callable[[int], bool | list[int]]
    on_done: Callable[[str], None]
    forced: list[int] = field(default_factory=list)
    banned: frozenset = frozenset()
    logit_bias: dict[int, float] = field(default_factory=dict)  # token -> added to its logit
    deadline: float | None = None  # time.monotonic() by which it must end ("timeout")
    id: str = ""  # for logs
    session: Session | None = None  # continue this session (holds `prompt`); its state comes back at the end
    step_logits: list | None = None  # if a list: receives the [V] float32 logits each token was sampled from
    cancelled: bool = False
    new_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens restored from the state cache, not prefilled
    # decode steps after its first that ran at a new batched-state shape (rows, capacity):
    # each runs a program of that shape, compiled or read back on first use; and their seconds
    reshape_steps: int = 0
    reshape_s: float = 0.0
    outcome: str | None = None  # the reason it ended, once it has
    error: Exception | None = None  # the exception behind an "error: ..." outcome, when one raised
    idle: bool = False  # a prefill into the state cache at low priority, no token (`submit_idle`)
    seq: int = -1  # the order the engine took it in (from `_sync` on): its name on every process

    def bias(self) -> dict[int, float] | None:
        """The row's logit bias: logit_bias, banned tokens at -inf."""
        if not self.banned:
            return self.logit_bias or None
        return {**self.logit_bias, **{int(t): -np.inf for t in self.banned}}


@dataclass(eq=False)
class _Row:
    job: Job
    pos: int  # where the next fed token goes (= tokens fed so far)
    token: int  # the next token to feed (the last one emitted)
    budget: int  # new tokens it may produce in all
    key: np.ndarray  # the job's PRNG key data (jax.random.PRNGKey(seed), on the host)
    forced: collections.deque


@dataclass(eq=False)
class _Prefill:
    job: Job
    session: object = None  # None until the state cache / a new session gives one
    done: int = 0  # prompt tokens fed
    snapshots: list[int] = field(default_factory=list)  # positions after which the state cache takes one


def batch_buckets(max_batch: int) -> list[int]:
    """Row counts the step compiles for: powers of two below max_batch, and max_batch."""
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
    return sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})


def capacity_buckets(max_seq_len: int) -> list[int]:
    """State capacities in use: MIN_CAPACITY x 4^i below the context, and the context."""
    caps, c = [], MIN_CAPACITY
    while c < max_seq_len:
        caps.append(c)
        c *= 4
    return caps + [max_seq_len]


@partial(jax.jit, donate_argnums=0)
def _put_row(state, row, slot):
    """Write a batch-1 state `row` into row `slot` of the batched `state`."""
    return jax.tree.map(lambda a, r: a.at[slot].set(r[0].astype(a.dtype)), state, row)


class Scheduler:
    def __init__(self, model: Model, max_batch: int = 4, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, state_cache=None,
                 max_queue: int = DEFAULT_MAX_QUEUE, replica=None):
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive number of tokens, got {prefill_chunk!r}")
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be a positive number of requests, got {max_queue!r}")
        self.model, self.max_batch, self.prefill_chunk, self.max_queue = model, max_batch, prefill_chunk, max_queue
        self.solo_chunk = max(prefill_chunk, min(SOLO_PREFILL_CHUNK, model.prefill_chunk))
        self.state_cache = state_cache  # engine.state_cache.StateCache, or None
        self.buckets = batch_buckets(max_batch)
        self.capacities = capacity_buckets(model.max_seq_len)
        self.eos = model.eos_ids
        self._inbox: list[Job] = []  # submitted since the last step (`_sync` takes them in)
        self._queue: collections.deque[Job] = collections.deque()
        self._idle: collections.deque[Job] = collections.deque()  # at most IDLE_JOBS: the newest win
        self.idle_grace_s = IDLE_GRACE_S
        self._last_request_work = 0.0  # time.monotonic() of the last step with a request to serve
        self._idle_ok = False  # this step may start idle work (decided in `_sync`)
        self._seq = itertools.count()
        self.replica = replica  # engine.replica.Leader / Follower (several processes), or None
        self.lost: Exception | None = None  # a peer process gone, or this one diverged: nothing can go on
        self._peers_checked = time.monotonic()
        self._cv = threading.Condition()
        self._prefill: _Prefill | None = None
        self._rows: list[_Row | None] = []  # [Bp]
        self._state = None  # batched per-layer state [Bp, ..., S, ...]
        self._cap = 0
        self._step_shape: tuple[int, int] | None = None  # (rows, capacity) of the last decode step
        self._counts = collections.Counter()
        self.accepting = True
        self.degraded: str | None = None  # why the engine cannot serve, while it cannot
        self.lock = threading.Lock()  # held for each step: readers of the model's telemetry take it too
        self.listeners: list[Callable[[Job, str], None]] = []  # told of every job's end (metrics)
        self.memory = model.memory  # engine.memory.DeviceMemory or None
        if self.memory is not None:
            self.memory.register(self)

    # ---- any thread --------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue a job; raises NotAccepting (draining or degraded) or QueueFull."""
        with self._cv:
            if not self.accepting:
                raise NotAccepting("the server is shutting down and accepts no new requests")
            if self.degraded:
                raise NotAccepting(f"the engine is degraded: {self.degraded}")
            if self._queued() >= self.max_queue:
                self._counts["rejected"] += 1
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self._inbox.append(job)
            self._cv.notify()

    def submit_idle(self, prompt: np.ndarray, on_done: Callable[[str], None] = lambda reason: None) -> bool:
        """Prefill `prompt` into the state cache when the engine has nothing else to do
        (no request queued or running), at low priority: a request that arrives meanwhile
        preempts it at the next chunk boundary (the part done is kept in the state cache).
        Only the newest IDLE_JOBS wait; no token is produced. on_done(reason): "idle"
        (prefilled), "preempted", or an error. -> False when there is no state cache or
        the engine takes no work."""
        if self.state_cache is None:
            return False
        job = Job(np.asarray(prompt, np.int32), 0, Sampling(), lambda tok: True, on_done, idle=True)
        with self._cv:
            if not self.accepting or self.degraded:
                return False
            self._inbox.append(job)
            self._cv.notify()
        return True

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        with self._cv:
            self._cv.notify()

    def drain(self) -> None:
        """Stop admitting; what is queued or running goes on."""
        with self._cv:
            self.accepting = False  # the next step drops the idle work: it is for a server that goes on
            self._cv.notify()

    def fail_pending(self, reason: str) -> None:
        """End every queued and running job with `reason` (a shutdown past its deadline).
        Takes the step lock: returns once the engine thread is between steps."""
        with self.lock:
            if self.leading:
                self.replica.publish({"k": "fail_all", "reason": reason})
            self._fail_all(reason, None)

    def _fail_all(self, reason: str, error: Exception | None) -> None:
        """End every queued, prefilling and decoding job with `reason` (on the engine
        thread, or holding the step lock)."""
        with self._cv:
            queued, self._queue = list(self._queue) + [j for j in self._inbox if not j.idle], collections.deque()
            self._inbox = []
        for job in queued:
            job.error = error
            self._finish(job, reason)
        self._fail_batch(reason, error, prefill=True)

    def pending(self) -> int:
        """Jobs queued, prefilling or decoding."""
        return self._queued() + (self._prefill is not None) + sum(r is not None for r in self._rows)

    @property
    def leading(self) -> bool:
        """Process 0 of several: its decisions go to the others (`engine.replica`)."""
        return self.replica is not None and not self.replica.follower

    def _queued(self) -> int:
        return len(self._queue) + sum(not j.idle for j in self._inbox)

    def stats(self) -> dict:
        rows = [r for r in self._rows if r is not None]
        return {"queued": self._queued(), "prefilling": int(self._prefill is not None), "active": len(rows),
                "max_batch": self.max_batch, "max_queue": self.max_queue, "batch_rows": len(self._rows),
                "capacity": self._cap, "accepting": self.accepting, "degraded": self.degraded,
                **{k: self._counts[k] for k in ("steps", "admitted", "finished", "cancelled", "timeouts", "errors",
                                                "rejected", "recoveries", "peak_active")},
                "idle": {"waiting": len(self._idle), **{k: self._counts[f"idle_{k}"] for k in (
                    "admitted", "done", "preempted", "dropped", "tokens")}}}

    # ---- the engine thread -------------------------------------------------------------------
    def run(self, stop: threading.Event, idle_s: float = 0.25) -> None:
        """Iterate until `stop` is set (or a peer process is lost); sleep while there is
        nothing to do (idle work waiting out its grace: until the grace ends)."""
        while not stop.is_set() and self.lost is None:
            with self._cv:
                busy = self.busy()
                if not busy:
                    self._cv.wait(min(idle_s, self._idle_wait()) if self._idle else idle_s)
            if busy:
                with self.lock:
                    self.step()
            elif self.replica is not None:
                with self.lock:
                    self._watch_peers()

    def _watch_peers(self) -> None:
        """Several processes, nothing to do: every PEER_CHECK_S, check that the others are
        still there (a lost one is found here rather than by the next request)."""
        if time.monotonic() - self._peers_checked < PEER_CHECK_S:
            return
        self._peers_checked = time.monotonic()
        try:
            self.replica.check_peers()
        except Exception as e:
            self._failed("idle", e, batch=True)

    def device_state_bytes(self) -> int:
        """The batched state's bytes (for the elastic memory budget)."""
        return 0 if self._state is None or consumed(self._state) else tree_bytes(self._state)

    def need_bytes(self, job: Job) -> int:
        """Device bytes admitting a job adds when it joins the batch: its prefill
        session's state plus the batched state's growth (a row, maybe more rows and a
        larger capacity for all). Decoding grows it further, a bucket at a time."""
        cap = self._capacity(job.prompt.size + 1)
        session = self.memory.state_bytes(cap)
        if self._state is None:
            return session  # the batch adopts the session's state
        return session + self._batch_growth(cap)

    def _batch_growth(self, cap: int) -> int:
        """Bytes the batched state grows by when a row of capacity `cap` joins it."""
        rows = len(self._rows) if None in self._rows else next(b for b in self.buckets if b > len(self._rows))
        return self.memory.state_bytes(max(cap, self._cap), rows) - self.device_state_bytes()

    def busy(self) -> bool:
        return bool(self._inbox) or bool(self._queue) or self._prefill is not None or any(self._rows) or (
            bool(self._idle) and (self._idle_wait() == 0 or not self.accepting))

    def _idle_wait(self) -> float:
        """Seconds until idle work may start (0: now): IDLE_GRACE_S after the last step
        that had a request to serve."""
        return max(0.0, self._last_request_work + self.idle_grace_s - time.monotonic())

    def step(self, decision: dict | None = None, *, decode_unless: Callable[[], bool] | None = None) -> None:
        """One iteration: take in what arrived, end cancelled and expired jobs, one prefill
        chunk, one decode step. A failure ends the jobs it touched and leaves the scheduler
        serving. `decision`: on a follower process, the leader's `_sync` decision.
        `decode_unless`: asked after the prefill part; True leaves the decode step to the
        next iteration (the Python API's stream shows a first token before the decode step
        that, in a new process, compiles)."""
        self._sync(decision)
        self._preempt_idle()
        if self._queue or any(self._rows) or (self._prefill is not None and not self._prefill.job.idle):
            self._last_request_work = time.monotonic()
        if self._prefill is not None or self._queue or (self._idle and not any(self._rows) and self._idle_ok):
            try:
                while self._advance_prefill() and self._queue:
                    pass  # jobs that need no prefill (continued sessions, whole-prompt cache hits) join together
            except Exception as e:
                self._failed("prefill", e, batch=self._state is not None and consumed(self._state))
        if any(self._rows) and not (decode_unless is not None and decode_unless()):
            try:
                self._decode()
            except Exception as e:
                self._failed("decode", e, batch=True)

    def _sync(self, decision: dict | None) -> None:
        """The step's one input from outside the engine thread: the jobs that arrived, the
        jobs that ended (cancelled, past their deadline), whether idle work may start (the
        grace), whether to drop idle work (draining). Read here from the inbox, flags and
        clocks, once, and published to the other processes (leader); or taken from the
        leader's `decision` (follower)."""
        r = self.replica
        if r is not None and r.follower:
            arrived = [r.mirror(wire) for wire in decision["jobs"]]
            self._take_in(arrived, decision["clear_idle"])
            ended = {r.jobs[seq]: why for seq, why in decision["ended"]}
            idle_ok = decision["idle_ok"]
        else:
            with self._cv:
                arrived, self._inbox = self._inbox, []
                clear_idle = not self.accepting
            for job in arrived:
                job.seq = next(self._seq)
            self._take_in(arrived, clear_idle)
            ended = self._ended(time.monotonic())
            idle_ok = not self._idle_wait()
            if r is not None:
                for job in arrived:
                    r.recording(job)
                r.publish({"k": "step", "jobs": [replica.job_wire(j) for j in arrived], "idle_ok": idle_ok,
                           "ended": [[j.seq, why] for j, why in ended.items()], "clear_idle": clear_idle})
        self._idle_ok = idle_ok
        self._drop_ended(ended)

    def _take_in(self, arrived: list[Job], clear_idle: bool) -> None:
        """Requests join the queue; idle jobs their own, where only the newest IDLE_JOBS
        wait (the rest, and all of them when draining, end "dropped")."""
        dropped = []
        with self._cv:
            for job in arrived:
                if not job.idle:
                    self._queue.append(job)
                    continue
                if len(self._idle) == IDLE_JOBS:
                    dropped.append(self._idle.popleft())
                self._idle.append(job)
            if clear_idle:
                dropped += self._idle
                self._idle.clear()
        for job in dropped:
            self._end_idle(job, "dropped")

    def _finish(self, job: Job, reason: str) -> None:
        """The one way a job ends: exactly once, whatever its callbacks do."""
        if job.outcome is not None:
            return
        if job.idle:  # not a request: its own counters
            self._end_idle(job, "error" if reason.startswith("error") else reason)
            return
        job.outcome = reason
        kind = reason.split(":")[0]
        self._counts[{"cancelled": "cancelled", "timeout": "timeouts", "error": "errors"}.get(kind, "finished")] += 1
        for fn in [job.on_done, *self.listeners]:
            try:
                fn(reason) if fn is job.on_done else fn(job, reason)
            except Exception:
                log.exception("job %s: a done callback raised", job.id or id(job))

    def _failed(self, where: str, e: Exception, batch: bool) -> None:
        """A step raised: fail the prefilling job (and the batch's rows when their state is
        gone), rebuild what the failure consumed, log it, go on. When a peer process of a
        distributed model is gone nothing can go on: every job ends with that error and
        the scheduler stays degraded."""
        e = distributed.step_error(e)
        if isinstance(e, distributed.DistributedError):  # a peer gone, or this process diverged
            log.error("%s step failed: %s", where, e)
            self._fail_all(f"error: {type(e).__name__}: {e}", e)
            self.degraded, self.lost = str(e), e
            return
        if self.replica is not None:  # every process fails the same step, or they part here
            try:
                if self.replica.follower:
                    self.replica.next("failed")
                else:
                    self.replica.publish({"k": "failed", "where": where})
            except Exception as err:
                return self._failed(where, err, batch=True)
        reason = f"error: {type(e).__name__}: {e}"
        ids = ([self._prefill.job.id] if self._prefill else []) + \
              ([r.job.id for r in self._rows if r is not None] if batch else [])
        log.error("%s step failed (jobs %s): %s", where, ", ".join(i or "?" for i in ids), reason, exc_info=e)
        self._fail_batch(reason, e, prefill=True, rows=batch)
        try:
            if self.model.recover():
                self._counts["recoveries"] += 1
            self.degraded = None
        except Exception as err:  # cannot rebuild: refuse new work rather than fail every request later
            self.degraded = f"cannot rebuild the expert cache after a failed {where} step: {type(err).__name__}: {err}"
            log.exception("recovery failed")

    def _fail_batch(self, reason: str, error: Exception | None, prefill: bool, rows: bool = True) -> None:
        jobs = []
        if prefill and self._prefill is not None:
            p, self._prefill = self._prefill, None
            jobs.append(p.job)
            if p.session is not None and p.session._state is not None and consumed(p.session._state):
                p.session._hand_back(None, 0)  # a continued session keeps its tokens, re-prefilled next time
            elif p.job.session is None and p.session is not None:
                p.session.close()
        if rows:
            for r in self._rows:
                if r is not None:
                    jobs.append(r.job)
                    if r.job.session is not None:
                        r.job.session._hand_back(None, 0)  # its state went with the batch's
            self._rows, self._state, self._cap = [], None, 0
            if self.memory is not None:
                self.memory.rebalance()
        for job in jobs:
            job.error = error
            self._finish(job, reason)

    def _ended(self, now: float) -> dict[Job, str]:
        """Queued, prefilling and decoding jobs that end now: cancelled, or "timeout"
        (past their deadline)."""
        jobs = [*self._queue, *([self._prefill.job] if self._prefill else []), *(r.job for r in self._rows if r)]
        return {j: "cancelled" if j.cancelled else "timeout" for j in jobs
                if j.cancelled or (j.deadline is not None and now > j.deadline)}

    def _drop_ended(self, ended: dict[Job, str]) -> None:
        """The `ended` jobs leave, with their reason."""
        with self._cv:
            gone = [j for j in self._queue if j in ended]
            for j in gone:
                self._queue.remove(j)
        for j in gone:
            self._finish(j, ended[j])
        if self._prefill is not None and self._prefill.job in ended:
            p, self._prefill = self._prefill, None
            if p.session is not None and p.job.session is None:
                p.session.close()
            self._finish(p.job, ended[p.job])
        for b, r in enumerate(self._rows):
            if r is not None and r.job in ended:
                self._leave(b, ended[r.job])
        self._compact()

    # ---- prefill and joining -----------------------------------------------------------
    def _advance_prefill(self) -> bool:
        """Admit the next job or feed the admitted one a chunk; join it to the batch when
        its prompt is in -> True if a job joined without any prefill (another may follow)."""
        if self._prefill is None:
            live = sum(r is not None for r in self._rows)
            with self._cv:
                if self._queue and live < self.max_batch:
                    job = self._queue[0]
                    if self.memory is not None and live and not self.memory.fits(self.need_bytes(job)):
                        return False  # waits for running rows to leave (it fits alone: checked at submission)
                    self._queue.popleft()
                elif self._idle and not live and not self._queue and self._idle_ok:  # idle work
                    job = self._idle.pop()  # the newest prediction first
                    if self.memory is not None and not self.memory.fits(self.need_bytes(job)):
                        self._end_idle(job, "dropped")
                        return False
                else:
                    return False
                self._prefill = p = _Prefill(job)  # tracked from here on: a failure below ends it
            self._counts["idle_admitted" if job.idle else "admitted"] += 1
            cap = self._capacity(job.prompt.size + 1)
            if job.session is not None:  # a continued session: the prompt is in, its logits ready
                if job.session._next_logits is None or job.session._fed != job.prompt.size:
                    raise ValueError("a continued session must hold its prompt fed, with next-token logits")
                p.session, p.done = job.session, job.prompt.size
            elif self.state_cache is not None:
                p.session, p.done = self.state_cache.restore(job.prompt, cap)
                p.snapshots = [b for b in self.state_cache.boundaries(job.prompt) if b > p.done]
            else:
                p.session = self.model.session()
            job.cached_tokens = p.done
            p.session.reserve(cap)
        p = self._prefill
        chunk = self.prefill_chunk if any(self._rows) or p.job.idle else self.solo_chunk  # idle work yields soon
        end = min(p.done + chunk, p.job.prompt.size, *p.snapshots[:1])  # a chunk ends at a snapshot
        fed = end > p.done
        if fed:
            p.session.append(p.job.prompt[p.done:end])
            p.done = end
        if p.snapshots and p.done == p.snapshots[0]:
            p.snapshots.pop(0)
            self._snapshot(p.session, "prompt" if p.done == p.job.prompt.size else "boundary")
        if p.done == p.job.prompt.size:
            self._prefill = None
            if p.job.idle:  # in the state cache now (its end is a snapshot): nothing to decode
                self._counts["idle_tokens"] += p.done - p.job.cached_tokens
                p.session.close()
                self._end_idle(p.job, "idle")
                return False
            self._join(p)
            return not fed
        return False

    def _preempt_idle(self) -> None:
        """A request is waiting or decoding: the idle prefill in progress stops here (its
        chunks so far go into the state cache, so they are not lost)."""
        p = self._prefill
        if p is None or not p.job.idle or not (self._queue or any(self._rows)):
            return
        self._prefill = None
        if p.session is not None and p.done > p.job.cached_tokens:
            self._counts["idle_tokens"] += p.done - p.job.cached_tokens
            self._snapshot(p.session, "predicted")
        if p.session is not None:
            p.session.close()
        self._end_idle(p.job, "preempted")

    def _end_idle(self, job: Job, reason: str) -> None:
        job.outcome = reason
        self._counts["idle_done" if reason == "idle" else f"idle_{reason}"] += 1
        try:
            job.on_done(reason)
        except Exception:
            log.exception("idle job: its done callback raised")

    def _snapshot(self, session, kind: str) -> None:
        """Into the state cache; the cache is an optimisation, so a failure there (a full
        disk, a device allocation) is logged and the request goes on."""
        try:
            self.state_cache.insert(session, kind)
        except Exception as e:
            self._counts["state_cache_errors"] += 1
            log.warning("state cache: snapshot not taken (%s: %s); the request goes on", type(e).__name__, e)

    def _join(self, p: _Prefill) -> None:
        """First token from the prefill logits; then a row of the batch (unless done)."""
        job, session, m = p.job, p.session, self.model
        smp = job.sampling
        key = key_data(smp.seed)  # host data: a step stacks the rows' keys in numpy
        forced = collections.deque(job.forced)
        budget = min(job.max_new_tokens, m.max_seq_len - job.prompt.size)
        greedy = smp.temperature == 0 and not forced
        logits = np.asarray(session._next_logits, np.float32)[0] if greedy or job.step_logits is not None else None
        if job.step_logits is not None:
            job.step_logits.append(logits)
        if forced:
            tok = forced.popleft()
        else:
            # greedy: the argmax on the host, as `_first_tokens` would give it, without its
            # program (restarted default model, 2,000-token prompt: ~0.1 s of the first token)
            tok = greedy_token(logits, job.bias()) if greedy else None
        if tok is None:
            t, k, top_p = smp.rows(1)
            tok = int(np.asarray(_first_tokens(session._next_logits, key[None], np.zeros(1, np.int32), t, k, top_p,
                                               *bias_arrays([job.bias()], m.config.vocab_size)))[0])
        row = _Row(job, pos=job.prompt.size, token=tok, budget=budget, key=key, forced=forced)
        if self._emit(row, tok):
            if job.session is not None:
                session._hand_back(session._state, session.capacity)  # the first token is pending
            else:
                session.close()  # done at its first token: its state goes (the expert cache may grow back)
            return
        self._place(row, session)

    def _place(self, row: _Row, session) -> None:
        cap = self._capacity(max([row.pos + 1] + [r.pos + 1 for r in self._rows if r is not None]))
        if self._state is None:  # the batch of one adopts the session's state
            self._state = session._state if session.capacity == cap else \
                resize_state(self.model.config, session._state, cap)
            session._state = None
            self._rows, self._cap = [row], cap
            self._counts["peak_active"] = max(self._counts["peak_active"], 1)
            return
        if self.memory is not None:  # the expert cache yields before the batched state grows
            self.memory.make_room(self._batch_growth(cap), "the batched state")
        if cap > self._cap:
            self._state, self._cap = resize_state(self.model.config, self._state, cap), cap
        if None not in self._rows:
            self._resize_rows(next(b for b in self.buckets if b > len(self._rows)))
        slot = self._rows.index(None)
        state = session._state if session.capacity == self._cap else \
            resize_state(self.model.config, session._state, self._cap)
        session._state = None
        self._state = _put_row(self._state, state, slot)
        self._rows[slot] = row
        self._counts["peak_active"] = max(self._counts["peak_active"], sum(r is not None for r in self._rows))
        if self.memory is not None:
            self.memory.rebalance()  # the prefill session's state is now part of the batch

    def _capacity(self, tokens: int) -> int:
        return next(c for c in self.capacities if c >= min(tokens, self.model.max_seq_len))

    def _resize_rows(self, n: int, keep: list[int] | None = None) -> None:
        """Grow to n rows (empty rows appended) or keep only rows `keep` (in order), padded to n."""
        keep = list(range(len(self._rows))) if keep is None else keep
        state = jax.tree.map(lambda a: a[np.asarray(keep)], self._state) if len(keep) < len(self._rows) \
            else self._state
        if n > len(keep):
            pad = self.model.new_state(n - len(keep), self._cap)
            state = jax.tree.map(lambda a, z: jnp.concatenate([a, z.astype(a.dtype)]), state, pad)
        self._state = state
        self._rows = [self._rows[i] for i in keep] + [None] * (n - len(keep))

    def _compact(self) -> None:
        """Shrink to the smallest row and capacity buckets that hold the live rows."""
        live = [b for b, r in enumerate(self._rows) if r is not None]
        before = (len(self._rows), self._cap)
        if not live:
            self._rows, self._state, self._cap = [], None, 0
        else:
            n = next(b for b in self.buckets if b >= len(live))
            if n < len(self._rows):
                self._resize_rows(n, live)
            cap = self._capacity(max(self._rows[b].pos + 1 for b in range(len(self._rows)) if self._rows[b]))
            if cap < self._cap:
                self._state, self._cap = resize_state(self.model.config, self._state, cap), cap
        if self.memory is not None and (len(self._rows), self._cap) != before:
            self.memory.rebalance()  # the batched state shrank: the expert cache grows back

    def _grow(self) -> None:
        """Before a decode step: the capacity must hold every live row's next token. Rows
        the device budget cannot grow for end with an error; the others go on."""
        need = max(r.pos + 1 for r in self._rows if r is not None)
        if need <= self._cap:
            return
        cap = self._capacity(need)
        if self.memory is not None:
            try:
                self.memory.make_room(self.memory.state_bytes(cap, len(self._rows)) - self.device_state_bytes(),
                                      f"the batched state at {cap} tokens")
            except DeviceMemoryError as e:
                for b, r in enumerate(self._rows):
                    if r is not None and r.pos + 1 > self._cap:
                        self._leave(b, f"error: DeviceMemoryError: {e}")
                self._compact()
                return
        self._state, self._cap = resize_state(self.model.config, self._state, cap), cap

    def warmup(self) -> float:
        """Compile the programs the loop meets (prefill chunk x capacity, decode and row
        insertion x batch x capacity) -> seconds; a chunk cut short by the end of a
        session's capacity may still compile later. Inactive rows leave the expert cache
        alone; the prefills do touch it, so it is cleared afterwards, with the counters."""
        m, t0 = self.model, time.perf_counter()
        chunks = {bucket(n) for n in range(1, self.solo_chunk + 1)}  # a chunk's padded lengths
        for cap in self.capacities:
            for T in sorted({min(t, cap) for t in chunks}):
                s = m.session()
                s.reserve(cap)
                s.append(np.zeros(T, np.int32))
            for Bp in self.buckets:
                state = _put_row(m.new_state(Bp, cap), m.new_state(1, cap), 0)
                zeros = np.zeros(Bp, np.int32)
                keys = np.stack([key_data(0)] * Bp)  # host data, as `_decode` passes them
                out = m.decode_step(state, zeros, zeros, np.zeros(Bp, bool), keys, zeros, np.zeros(Bp, np.float32),
                                    zeros, np.ones(Bp, np.float32))
                jax.block_until_ready(out[0])
        if self.state_cache is not None:
            self.state_cache.warmup(self.capacities)
        m.clear_expert_cache()
        m.reset_stats()
        return time.perf_counter() - t0

    # ---- decoding ------------------------------------------------------------------------
    def _decode(self) -> None:
        m = self.model
        self._grow()
        rows = self._rows
        if not any(rows):
            return
        Bp = len(rows)
        live = [b for b, r in enumerate(rows) if r is not None]
        key_data = rows[live[0]].key  # every row's key has its shape and dtype
        tokens, pos, counters = (np.zeros(Bp, np.int32) for _ in range(3))
        temperature, top_p = np.zeros(Bp, np.float32), np.ones(Bp, np.float32)
        top_k = np.zeros(Bp, np.int32)
        keys = np.zeros((Bp, *key_data.shape), key_data.dtype)  # an idle row's key is never used
        active = np.zeros(Bp, bool)
        for b in live:
            r = rows[b]
            s = r.job.sampling
            tokens[b], pos[b], counters[b], active[b], keys[b] = r.token, r.pos, r.job.new_tokens, True, r.key
            temperature[b], top_k[b], top_p[b] = s.temperature, s.top_k, s.top_p
        bias = bias_arrays([r.job.bias() if r is not None else None for r in rows], m.config.vocab_size)
        t0 = time.perf_counter()
        state, self._state = self._state, None  # donated: a failed step leaves no state behind
        out, logits, self._state = m.decode_step(state, tokens, pos, active, keys, counters, temperature,
                                                 top_k, top_p, bias)
        ids = np.asarray(out)  # the one host sync per step
        dt = time.perf_counter() - t0
        m.add_time(decode_s=dt, decode_tokens=len(live))
        self._counts["steps"] += 1
        reshaped, self._step_shape = (Bp, self._cap) != self._step_shape, (Bp, self._cap)
        if reshaped:
            for b in live:  # a row's own first decode step is its first_step_s already
                if rows[b].job.new_tokens >= 2:
                    rows[b].job.reshape_steps += 1
                    rows[b].job.reshape_s += dt
        with self.replica.batched() if self.leading else contextlib.nullcontext():  # the rows' answers: one record
            for b in live:
                r = rows[b]
                r.pos += 1
                if r.job.step_logits is not None:
                    r.job.step_logits.append(np.asarray(logits[b], np.float32))
                tok = r.forced.popleft() if r.forced else int(ids[b])
                r.token = tok
                if self._emit(r, tok):
                    self._release(b)
        self._compact()

    def _emit(self, row: _Row, tok: int) -> bool:
        """Hand a new token to its job; True when the job has finished (and been told)."""
        job = row.job
        job.new_tokens += 1
        try:
            stop = job.on_token(tok)
        except distributed.DistributedError:  # a follower that no longer matches the leader: not the job's fault
            raise
        except Exception as e:  # the job's own callback: it alone fails
            log.exception("job %s: on_token raised", job.id or id(job))
            self._finish(job, f"error: {type(e).__name__}: {e}")
            return True
        if isinstance(stop, list):
            row.forced.extend(stop)
            stop = False
        reason = ("stop" if stop else "eos" if tok in self.eos else
                  "" if job.new_tokens < row.budget else
                  "length" if row.budget == job.max_new_tokens else "context")
        if reason:
            self._finish(job, reason)
        return bool(reason)

    def _leave(self, b: int, reason: str) -> None:
        job = self._rows[b].job
        self._release(b)
        self._finish(job, reason)

    def _release(self, b: int) -> None:
        """Row b leaves the batch; a continued session takes its state back (a copy of the
        row, or the whole state when it is the only row)."""
        r, self._rows[b] = self._rows[b], None
        if r.job.session is None:
            return
        if not any(self._rows):
            state, self._state = self._state, None
            if len(self._rows) > 1:
                state = jax.tree.map(lambda a: a[b:b + 1], state)
        else:
            state = jax.tree.map(lambda a: a[b:b + 1], self._state)
        r.job.session._hand_back(state, self._cap, fed=r.pos)
