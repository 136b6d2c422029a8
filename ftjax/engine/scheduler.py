"""Continuous batching: requests join and leave one batched decode step while it runs.

`generate_batch` (engine.session) decodes a fixed set of sessions from start to end.
A server needs rows that come and go: the `Scheduler` keeps ONE batched state and
advances it one token per iteration, admitting new requests between steps.

    submit(job) ─► queue ─► prefill, one chunk of `prefill_chunk` tokens per iteration
                            (a batch-1 Session; a long prompt never stalls the others'
                            decode for more than one chunk)
                         ─► first token from the prefill's logits ─► joins a free row
    rows [Bp] ─► one jitted decode step per iteration (Steps.decode: per-row token,
                 position, active mask, key, counter, sampling) ─► each row's token to
                 its job's `on_token`; finished / cancelled rows leave at once

Shapes stay in a small set so the programs compile a bounded number of times: the
batch Bp is padded to a power of two (at most `max_batch`), the capacity S of the
batched state and of a prefilling session to MIN_CAPACITY x 4^i (at most the model's
context; attention reads only the keys in use, so a larger S costs memory, not time),
a prefill chunk to a power of two. The state grows (rows, capacity) when a joining row
needs it and is compacted to the smallest bucket that holds the live rows when rows
leave. `warmup()` compiles every shape up front.

A row samples exactly as a lone `Session.generate` would: token 0 from the prefill
logits with fold_in(PRNGKey(seed), 0), token i with counter i; so greedy and seeded
output does not depend on who else is in the batch. Two per-row controls serve
constrained output: `forced` tokens (given up front, or returned by `on_token` along
the way) are emitted and fed before any sampled one, and `banned` tokens are never chosen (the best allowed token of the step's logits instead).

Threading: `run()` is the engine loop on one thread (JAX calls are blocking);
`submit` / `cancel` / `stats` may be called from any thread. A cancelled job leaves
within one iteration (at most one prefill chunk plus one decode step) and its state
is dropped.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.engine.memory import tree_bytes
from ftjax.engine.session import MIN_CAPACITY, Sampling, _first_tokens, bucket
from ftjax.models.common import resize_state

if TYPE_CHECKING:
    from ftjax.model import Model


@dataclass(eq=False)
class Job:
    """One request's generation. `on_token(tok)` returns True to stop it (e.g. a stop
    string), or a list of tokens to force next (e.g. closing a reasoning budget);
    `on_done(reason)` is called once: eos | stop | length | context | cancelled | error: ..."""

    prompt: np.ndarray  # [T] int32, checked by the caller
    max_new_tokens: int
    sampling: Sampling
    on_token: Callable[[int], bool | list[int]]
    on_done: Callable[[str], None]
    forced: list[int] = field(default_factory=list)
    banned: frozenset = frozenset()
    cancelled: bool = False
    new_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens restored from the state cache, not prefilled


@dataclass(eq=False)
class _Row:
    job: Job
    pos: int  # where the next fed token goes (= tokens fed so far)
    token: int  # the next token to feed (the last one emitted)
    budget: int  # new tokens it may produce in all
    end: int  # prompt + budget: the capacity it needs
    key: jax.Array
    forced: collections.deque


@dataclass(eq=False)
class _Prefill:
    job: Job
    session: object
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
    def __init__(self, model: Model, max_batch: int = 4, prefill_chunk: int = 256, state_cache=None):
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive number of tokens, got {prefill_chunk!r}")
        self.model, self.max_batch, self.prefill_chunk = model, max_batch, prefill_chunk
        self.state_cache = state_cache  # engine.state_cache.StateCache, or None
        self.buckets = batch_buckets(max_batch)
        self.capacities = capacity_buckets(model.max_seq_len)
        self.eos = model.eos_ids
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._prefill: _Prefill | None = None
        self._rows: list[_Row | None] = []  # [Bp]
        self._state = None  # batched per-layer state [Bp, ..., S, ...]
        self._cap = 0
        self._counts = collections.Counter()
        self.lock = threading.Lock()  # held for each step: readers of the model's telemetry take it too
        self.memory = model.memory  # engine.memory.DeviceMemory or None
        if self.memory is not None:
            self.memory.register(self)

    # ---- any thread --------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cv:
            self._queue.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        with self._cv:
            self._cv.notify()

    def stats(self) -> dict:
        rows = [r for r in self._rows if r is not None]
        return {"queued": len(self._queue), "prefilling": int(self._prefill is not None), "active": len(rows),
                "max_batch": self.max_batch, "batch_rows": len(self._rows), "capacity": self._cap,
                **{k: self._counts[k] for k in ("steps", "admitted", "finished", "cancelled", "errors", "peak_active")}}

    # ---- the engine thread -------------------------------------------------------------------
    def run(self, stop: threading.Event, idle_s: float = 0.25) -> None:
        """Iterate until `stop` is set; sleep while there is nothing to do."""
        while not stop.is_set():
            with self._cv:
                if not self.busy():
                    self._cv.wait(idle_s)
                    continue
            with self.lock:
                self.step()

    def device_state_bytes(self) -> int:
        """The batched state's bytes (for the elastic memory budget)."""
        return tree_bytes(self._state)

    def need_bytes(self, job: Job) -> int:
        """Device bytes admitting a job adds at its peak (when it joins the batch): its
        prefill session's state plus the batched state's growth (a row, maybe more rows
        and a larger capacity for all)."""
        cap = self._capacity(job.prompt.size + job.max_new_tokens)
        session = self.memory.state_bytes(cap)
        if self._state is None:
            return session  # the batch adopts the session's state
        return session + self._batch_growth(cap)

    def _batch_growth(self, cap: int) -> int:
        """Bytes the batched state grows by when a row of capacity `cap` joins it."""
        rows = len(self._rows) if None in self._rows else next(b for b in self.buckets if b > len(self._rows))
        return self.memory.state_bytes(max(cap, self._cap), rows) - self.device_state_bytes()

    def busy(self) -> bool:
        return bool(self._queue) or self._prefill is not None or any(self._rows)

    def step(self) -> None:
        """One iteration: drop cancelled jobs, one prefill chunk, one decode step."""
        try:
            self._drop_cancelled()
            self._advance_prefill()
            if any(self._rows):
                self._decode()
        except Exception as e:  # a failed step fails its jobs; the loop (and server) go on
            self._fail_all(f"error: {type(e).__name__}: {e}")

    def _finish(self, job: Job, reason: str) -> None:
        self._counts["cancelled" if reason == "cancelled" else "finished"] += 1
        job.on_done(reason)

    def _fail_all(self, reason: str) -> None:
        self._counts["errors"] += 1
        jobs = [r.job for r in self._rows if r is not None] + ([self._prefill.job] if self._prefill else [])
        self._rows, self._state, self._cap, self._prefill = [], None, 0, None
        for job in jobs:
            self._finish(job, reason)

    def _drop_cancelled(self) -> None:
        with self._cv:
            gone = [j for j in self._queue if j.cancelled]
            for j in gone:
                self._queue.remove(j)
        for j in gone:
            self._finish(j, "cancelled")
        if self._prefill is not None and self._prefill.job.cancelled:
            p, self._prefill = self._prefill, None
            p.session.close()
            self._finish(p.job, "cancelled")
        for b, r in enumerate(self._rows):
            if r is not None and r.job.cancelled:
                self._leave(b, "cancelled")
        self._compact()

    # ---- prefill and joining -----------------------------------------------------------
    def _advance_prefill(self) -> None:
        if self._prefill is None:
            live = sum(r is not None for r in self._rows)
            with self._cv:
                if not self._queue or live >= self.max_batch:
                    return
                job = self._queue[0]
                if self.memory is not None and live and not self.memory.fits(self.need_bytes(job)):
                    return  # waits for running rows to leave (it fits alone: checked at submission)
                self._queue.popleft()
            cap = self._capacity(job.prompt.size + job.max_new_tokens)
            s, done, snapshots = self.model.session(), 0, []
            if self.state_cache is not None:
                s, done = self.state_cache.restore(job.prompt, cap)
                snapshots = [b for b in self.state_cache.boundaries(job.prompt) if b > done]
            job.cached_tokens = done
            s.reserve(cap)
            self._prefill = _Prefill(job, s, done, snapshots)
            self._counts["admitted"] += 1
        p = self._prefill
        end = min(p.done + self.prefill_chunk, p.job.prompt.size, *p.snapshots[:1])  # a chunk ends at a snapshot
        if end > p.done:
            p.session.append(p.job.prompt[p.done:end])
            p.done = end
        if p.snapshots and p.done == p.snapshots[0]:
            p.snapshots.pop(0)
            self.state_cache.insert(p.session, "prompt" if p.done == p.job.prompt.size else "boundary")
        if p.done == p.job.prompt.size:
            self._prefill = None
            self._join(p.job, p.session)

    def _join(self, job: Job, session) -> None:
        """First token from the prefill logits; then a row of the batch (unless done)."""
        m = self.model
        smp = job.sampling
        key = jax.random.PRNGKey(smp.seed)
        forced = collections.deque(job.forced)
        budget = min(job.max_new_tokens, m.max_seq_len - job.prompt.size)
        logits = session._next_logits  # [1, V]
        if forced:
            tok = forced.popleft()
        else:
            t, k, p = smp.rows(1)
            tok = int(np.asarray(_first_tokens(logits, key[None], np.zeros(1, np.int32), t, k, p))[0])
            if tok in job.banned:
                tok = _best_allowed(np.asarray(logits[0]), job.banned)
        row = _Row(job, pos=job.prompt.size, token=tok, budget=budget, end=job.prompt.size + budget, key=key,
                   forced=forced)
        if self._emit(row, tok):
            session.close()  # done at its first token: its state goes (the expert cache may grow back)
            return
        self._place(row, session)

    def _place(self, row: _Row, session) -> None:
        cap = self._capacity(max([row.end] + [r.end for r in self._rows if r is not None]))
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
        live = [b for b, r in enumerate(self._rows) if r is not None]
        before = len(self._rows)
        if not live:
            self._rows, self._state, self._cap = [], None, 0
        else:
            n = next(b for b in self.buckets if b >= len(live))
            if n < len(self._rows):
                self._resize_rows(n, live)
        if self.memory is not None and len(self._rows) < before:
            self.memory.rebalance()  # the batched state shrank: the expert cache grows back

    def warmup(self) -> float:
        """Compile the programs the loop meets (prefill chunk x capacity, decode and row
        insertion x batch x capacity) -> seconds; a chunk cut short by the end of a
        session's capacity may still compile later. Inactive rows leave the expert cache
        alone; the prefills do touch it, so it is cleared afterwards, with the counters."""
        m, t0 = self.model, time.perf_counter()
        chunks = {bucket(n) for n in range(1, self.prefill_chunk + 1)}  # a chunk's padded lengths
        for cap in self.capacities:
            for T in sorted({min(t, cap) for t in chunks}):
                s = m.session()
                s.reserve(cap)
                s.append(np.zeros(T, np.int32))
            for Bp in self.buckets:
                state = _put_row(m.new_state(Bp, cap), m.new_state(1, cap), 0)
                zeros = np.zeros(Bp, np.int32)
                out = m._steps.decode(m._params, state, m._xstate, m._pool_dev, jnp.asarray(zeros), zeros,
                                      np.zeros(Bp, bool), jnp.stack([jax.random.PRNGKey(0)] * Bp), zeros,
                                      np.zeros(Bp, np.float32), zeros, np.ones(Bp, np.float32))
                m._xstate = out[3]
                jax.block_until_ready(out[0])
        if self.state_cache is not None:
            self.state_cache.warmup(self.capacities)
        m.clear_expert_cache()
        m.reset_stats()
        return time.perf_counter() - t0

    # ---- decoding ------------------------------------------------------------------------
    def _decode(self) -> None:
        m = self.model
        rows = self._rows
        Bp = len(rows)
        live = [b for b, r in enumerate(rows) if r is not None]
        tokens, pos, counters = (np.zeros(Bp, np.int32) for _ in range(3))
        temperature, top_p = np.zeros(Bp, np.float32), np.ones(Bp, np.float32)
        top_k = np.zeros(Bp, np.int32)
        keys = [jax.random.PRNGKey(0)] * Bp
        active = np.zeros(Bp, bool)
        for b in live:
            r = rows[b]
            s = r.job.sampling
            tokens[b], pos[b], counters[b], active[b], keys[b] = r.token, r.pos, r.job.new_tokens, True, r.key
            temperature[b], top_k[b], top_p[b] = s.temperature, s.top_k, s.top_p
        t0 = time.perf_counter()
        out, logits, self._state, m._xstate, codes = m._steps.decode(
            m._params, self._state, m._xstate, m._pool_dev, jnp.asarray(tokens), pos, active, jnp.stack(keys),
            counters, temperature, top_k, top_p)
        m._telemetry.record("decode", codes)
        ids = np.asarray(out)  # the one host sync per step
        m.calibrate()
        timing = m._telemetry.timing
        timing.decode_s += time.perf_counter() - t0
        timing.decode_tokens += len(live)
        self._counts["steps"] += 1
        for b in live:
            r = rows[b]
            r.pos += 1
            tok = r.forced.popleft() if r.forced else int(ids[b])
            if tok in r.job.banned:
                tok = _best_allowed(np.asarray(logits[b]), r.job.banned)
            r.token = tok
            if self._emit(r, tok):
                rows[b] = None
        self._compact()

    def _emit(self, row: _Row, tok: int) -> bool:
        """Hand a new token to its job; True when the job has finished (and been told)."""
        job = row.job
        job.new_tokens += 1
        stop = job.on_token(tok)
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
        self._rows[b] = None
        self._finish(job, reason)


def _best_allowed(logits: np.ndarray, banned: frozenset) -> int:
    """The most likely token of logits [V] that is not banned."""
    order = np.argsort(-logits)
    return int(next(t for t in order if int(t) not in banned))
