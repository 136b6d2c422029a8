"""Sessions: one conversation's state, resumable, forkable, and decodable in a batch.

A `Model` holds what every request shares: weights, the host expert pool, the expert
executor and its device cache (global: sessions share hot experts), the compiled steps
and telemetry. A `Session` holds what one conversation owns:

    state        tuple of per-layer state pytrees (`models.common.init_state`), batch 1,
                 capacity S (grown in buckets as the conversation grows)
    ids          the tokens it holds; all but at most one are *fed* (their state is in
                 `state`): after `generate`, the last sampled token is pending and is
                 fed by the next call
    next logits  [1, V] after the last fed token (what the next token is sampled from)
    timing       its own prefill / decode seconds and token counts

    s = model.session()              empty
    s.append(ids) -> logits [V]      prefill from s.position on
    s.generate(n, ...) -> new ids    continue; the new tokens become part of the session
    s.fork()                         independent copy (buffers copied: steps donate them)
    s.snapshot() -> Snapshot         host copy at s.position (+ ids, next logits, the
                                     model's fingerprint); model.session(snap) resumes it;
                                     Snapshot.save / load persist it (orbax-checkpoint)

Generation runs on the model's `Scheduler` (engine.scheduler), the same decode loop the
server uses: `generate` and `generate_batch` submit one job per session that continues
it, and step the scheduler on the calling thread until their jobs end. Rows decode
together, one jitted step per token, each at its own position; a row's state goes back
to its session when its job ends. Several live `generate_stream` generators of one
model share that loop: stepping one advances them all.
"""

from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.engine.memory import tree_bytes
from ftjax.engine.sampling import apply_bias, sample
from ftjax.engine.shapes import MIN_CAPACITY, MIN_PROMPT_BUCKET, bucket, prefill_pieces  # noqa: F401 (re-exported)
from ftjax.engine.stops import StopMatcher, check_stops
from ftjax.engine.telemetry import Timing
from ftjax.models.common import resize_state

if TYPE_CHECKING:
    from ftjax.model import Model

SNAPSHOT_FORMAT = 1


@jax.jit
def _first_tokens(logits, keys, counters, temperature, top_k, top_p, bias_ids, bias_values):
    """Sample from logits [B, V] + bias (ids / values [B, K]) with fold_in(keys[b],
    counters[b]) per row -> [B]."""
    logits = apply_bias(logits, bias_ids, bias_values)
    return sample(logits, jax.vmap(jax.random.fold_in)(keys, counters), temperature, top_k, top_p)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0  # first token: prefill (+ compile on first use) + first sample
    decode_s: float = 0.0  # every decode step after the first token
    first_step_s: float = 0.0  # the first decode step alone (includes its compile on first use)
    # later decode steps at a new state shape (the capacity grew a bucket, or the batch
    # took more rows): each runs a program of that shape, compiled or read back from the
    # persistent cache on first use; and their seconds (part of decode_s)
    reshape_steps: int = 0
    reshape_s: float = 0.0
    stop_reason: str = ""

    @property
    def decode_tok_per_s(self) -> float:
        """Steady decode speed: tokens after the first decode step over their time, the
        steps at a new state shape left out (the first step is `first_step_s`, the others
        `reshape_s`: on first use they compile)."""
        n = self.new_tokens - 2 - self.reshape_steps
        t = self.decode_s - self.first_step_s - self.reshape_s
        if n > 0 and t > 0:
            return n / t
        n = self.new_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not np.isfinite(v):
                raise ValueError(f"bad sampling setting: {name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise ValueError(f"bad sampling setting: temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"bad sampling setting: top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"bad sampling setting: top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")

    def rows(self, batch: int):
        """Per-row host arrays (a step's operands; no eager program): temperature, top_k,
        top_p [batch]."""
        return (np.full((batch,), self.temperature, np.float32), np.full((batch,), self.top_k, np.int32),
                np.full((batch,), self.top_p, np.float32))


# ---- snapshots ---------------------------------------------------------------------------

@dataclass
class Snapshot:
    """A session's state on the host, trimmed to its position."""

    state: tuple  # per-layer numpy pytrees, capacity = position
    ids: list[int]
    next_logits: np.ndarray  # [V] float32
    fingerprint: str  # the model (config + weights) it belongs to

    @property
    def position(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self.state)) + self.next_logits.nbytes

    def save(self, path: str | Path) -> Path:
        """Write to a new folder (orbax-checkpoint for the arrays, JSON for the rest)."""
        import orbax.checkpoint as ocp

        path = Path(path).absolute()
        if path.exists():
            raise FileExistsError(f"{path} exists: a snapshot is written to a new folder")
        tree = {"state": list(self.state), "next_logits": self.next_logits}
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(path / "arrays", tree)
        meta = {"format": SNAPSHOT_FORMAT, "fingerprint": self.fingerprint, "ids": list(map(int, self.ids))}
        (path / "snapshot.json").write_text(json.dumps(meta))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Snapshot:
        import orbax.checkpoint as ocp

        path = Path(path).absolute()
        meta_file = path / "snapshot.json"
        if not meta_file.is_file():
            raise FileNotFoundError(f"{path}: not an ftjax snapshot (no snapshot.json)")
        try:
            meta = json.loads(meta_file.read_text())
            if meta.get("format") != SNAPSHOT_FORMAT:
                raise ValueError(f"snapshot format {meta.get('format')!r}, this ftjax reads {SNAPSHOT_FORMAT}")
            with ocp.StandardCheckpointer() as ckpt:
                tree = ckpt.restore(path / "arrays")
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{path}: corrupt snapshot ({e})") from None
        state = tuple({k: np.asarray(v) for k, v in layer.items()} for layer in tree["state"])
        return cls(state, [int(t) for t in meta["ids"]], np.asarray(tree["next_logits"], np.float32),
                   str(meta["fingerprint"]))


# ---- the session -------------------------------------------------------------------------

class Session:
    def __init__(self, model: Model, snapshot: Snapshot | None = None):
        self.model = model
        self._state = None  # tuple of per-layer pytrees [1, S, ...]
        self._capacity = 0
        self._ids: list[int] = []
        self._fed = 0
        self._next_logits = None  # [1, V] device array
        self.timing = Timing()
        self.last_generation: GenerationStats | None = None
        if model.memory is not None:
            model.memory.register(self)  # its state counts in the device budget while it lives
        if snapshot is not None:
            self._restore(snapshot)

    # ---- what it holds ------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Tokens held (the next token goes at this position)."""
        return len(self._ids)

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    @property
    def capacity(self) -> int:
        return self._capacity

    def __repr__(self) -> str:
        return f"Session(position={self.position}, capacity={self._capacity})"

    # ---- state management ----------------------------------------------------------------
    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` tokens in all (capped at the model's max_seq_len), growing
        the state in buckets; existing state is kept."""
        m = self.model
        need = min(max(tokens, 1), m.max_seq_len)
        if self._state is not None and need <= self._capacity:
            return
        cap = min(m.max_seq_len, bucket(need, MIN_CAPACITY))
        if m.memory is not None:  # the expert cache yields first (or DeviceMemoryError, nothing changed)
            m.memory.make_room(m.memory.state_bytes(cap) - self.device_state_bytes(), f"a session state of {cap} tokens")
        if self._state is None:
            self._state = m.new_state(1, cap)
        else:
            self._state = resize_state(m.config, self._state, cap)
        self._capacity = cap

    def device_state_bytes(self) -> int:
        """Bytes of device memory its state holds (for the elastic memory budget)."""
        return tree_bytes(self._state)

    def close(self) -> None:
        """Release the state now (the expert cache may grow back into it); the session
        keeps its ids but can no longer be continued."""
        self._state, self._capacity, self._fed, self._next_logits = None, 0, 0, None
        self._ids = []
        if self.model.memory is not None:
            self.model.memory.rebalance()

    def _check_room(self, n: int) -> None:
        if self.position + n > self.model.max_seq_len:
            raise ValueError(f"{self.position} tokens held + {n} new = {self.position + n} do not fit the context of "
                             f"{self.model.max_seq_len} tokens (max_seq_len)")

    def _prefill(self, ids: np.ndarray, all_logits: bool = False):
        """Feed ids [T] from the fed position, in pieces of at most `model.prefill_chunk`
        tokens (activation memory O(chunk)) cut so that padding stays small
        (`shapes.prefill_pieces`) -> logits ([1, T, V] or [1, V]), device."""
        self.reserve(self._fed + ids.size)
        sizes = prefill_pieces(ids.size, self.model.prefill_chunk)
        if len(sizes) == 1:
            return self._prefill_chunk(ids, all_logits)
        chunks = np.split(ids, np.cumsum(sizes)[:-1])
        parts = [self._prefill_chunk(c, all_logits) for c in chunks]
        return jnp.concatenate([p[:, :c.size] for p, c in zip(parts, chunks)], axis=1) if all_logits else parts[-1]

    def _prefill_chunk(self, ids: np.ndarray, all_logits: bool):
        m = self.model
        T, start = ids.size, self._fed
        self.reserve(start + T)
        t_pad = min(bucket(T), self._capacity - start)
        tokens = np.zeros((1, t_pad), np.int32)  # [B, T bucket]
        tokens[0, :T] = ids
        state, self._state = self._state, None  # donated: if the step fails, the session has no state
        logits, self._state = m.prefill_step(state, tokens, np.array([start], np.int32), np.array([T], np.int32),
                                             all_logits)
        self._fed += T
        self._next_logits = logits[:, T - 1] if all_logits else logits
        return logits

    def _flush(self) -> None:
        """Feed the pending token (the last one `generate` sampled), if any."""
        if self._fed < len(self._ids):
            with self.model.recovering():
                self._prefill(np.asarray(self._ids[self._fed:], np.int32))

    def _append(self, ids, all_logits: bool):
        arr = self.model.check_ids(ids)
        self._check_room(arr.size)
        pending = self._ids[self._fed:]
        t0 = time.perf_counter()
        with self.model.recovering():
            logits = self._prefill(np.concatenate([np.asarray(pending, np.int32), arr]), all_logits)
            host = np.asarray(logits, np.float32)  # the whole [1, ...] array: slicing it on the device is an op
            out = host[0, len(pending):len(pending) + arr.size] if all_logits else host[0]
        self._ids.extend(int(t) for t in arr)
        self._add_prefill_time(time.perf_counter() - t0, arr.size)
        return out

    def _add_prefill_time(self, seconds: float, tokens: int) -> None:
        self.timing.add(prefill_s=seconds, prefill_tokens=tokens)
        self.model.add_time(prefill_s=seconds, prefill_tokens=tokens)

    def append(self, ids: Sequence[int]) -> np.ndarray:
        """Prefill `ids` after what the session holds -> [V] float32 logits of the last one."""
        return self._append(ids, all_logits=False)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Like `append`, but returns the logits at every appended token -> [T, V] float32."""
        return self._append(ids, all_logits=True)

    def fork(self) -> Session:
        """An independent copy: both sessions then continue separately."""
        other = Session(self.model)
        if self._state is not None:
            if self.model.memory is not None:
                self.model.memory.make_room(self.device_state_bytes(), "a forked session state")
            other._state = jax.tree.map(jnp.copy, self._state)
        other._capacity, other._ids, other._fed = self._capacity, list(self._ids), self._fed
        other._next_logits = self._next_logits
        return other

    def snapshot(self) -> Snapshot:
        """Host-side copy of the state at `position` (pending token fed first)."""
        if not self._ids:
            raise ValueError("the session is empty: nothing to snapshot")
        self._flush()
        trimmed = resize_state(self.model.config, self._state, self._fed)
        return Snapshot(jax.device_get(trimmed), list(self._ids), np.asarray(self._next_logits[0], np.float32),
                        self.model.fingerprint)

    def _restore(self, snap: Snapshot) -> None:
        m = self.model
        if snap.fingerprint != m.fingerprint:
            raise ValueError(f"snapshot belongs to another model or configuration (fingerprint {snap.fingerprint[:12]}, "
                             f"this model {m.fingerprint[:12]})")
        n = len(snap.ids)
        if n > m.max_seq_len:
            raise ValueError(f"snapshot holds {n} tokens, more than this model's max_seq_len {m.max_seq_len}")
        if snap.next_logits.shape != (m.config.vocab_size,):
            raise ValueError(f"snapshot logits have shape {snap.next_logits.shape}, expected ({m.config.vocab_size},)")
        expected = jax.tree.map(lambda a: a.shape, jax.eval_shape(
            lambda: resize_state(m.config, m.new_state(1, max(n, 1)), n)))
        got = jax.tree.map(lambda a: a.shape, snap.state)
        if got != expected:
            raise ValueError(f"snapshot state does not match this model's layers: {got} vs {expected}")
        self._adopt(tuple(snap.state), snap.ids, snap.next_logits)

    def _adopt(self, state: tuple, ids: Sequence[int], next_logits, capacity: int | None = None) -> None:
        """Take a state holding `ids` (host or device arrays; capacity len(ids), or
        `capacity` when it was built at its final size: then it is not resized) and the
        logits [V] after the last of them."""
        m, n = self.model, len(ids)
        cap = capacity or min(m.max_seq_len, bucket(n + 1, MIN_CAPACITY))
        if m.memory is not None:
            m.memory.make_room(m.memory.state_bytes(cap) - self.device_state_bytes(), f"a restored state of {cap} tokens")
        self._capacity = cap
        self._state = resize_state(m.config, jax.tree.map(jnp.asarray, state), self._capacity)
        self._ids, self._fed = [int(t) for t in ids], n
        self._next_logits = jnp.asarray(next_logits, jnp.float32)[None]

    def _hand_back(self, state, capacity: int, fed: int | None = None) -> None:
        """The scheduler returns the session's state when its job ends: `fed` tokens in
        it, the last emitted token pending. `state=None`: a failed step took it; the
        session keeps its tokens and feeds them all again on its next call."""
        if state is None:
            self._state, self._capacity, self._fed = None, 0, 0
        else:
            self._state, self._capacity = state, capacity
            self._fed = self._fed if fed is None else fed
        self._next_logits = None

    # ---- generation ------------------------------------------------------------------------
    def generate_stream(self, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                        seed: int = 0, stop: Sequence[str] | None = None, *, prompt: Sequence[int] | None = None,
                        step_logits: list | None = None) -> Iterator[int]:
        """Yield new token ids as they are produced; they become part of the session.
        `prompt` (optional) is appended first and counted in the TTFT. `step_logits`, if a
        list, receives the [V] logits each token was sampled from."""
        m = self.model
        arr = m.check_ids(prompt) if prompt is not None else None
        settings = _check_generation(m, max_new_tokens, Sampling(temperature, top_k, top_p, seed), stop)
        stats = self.last_generation = GenerationStats(prompt_tokens=arr.size if arr is not None else 0)
        if max_new_tokens == 0:
            return
        if arr is None and not self._ids:
            raise ValueError("the session is empty: append a prompt first (or pass prompt=...)")
        t0 = time.perf_counter()
        if arr is not None:
            self._check_room(arr.size)
            self._append(arr, all_logits=False)  # the pending token, if any, goes in with it
        else:
            self._flush()
        budget = min(max_new_tokens, m.max_seq_len - self.position)
        if budget <= 0:
            stats.stop_reason = "context"
            return
        yield from _run([self], max_new_tokens, settings, stop, t0, [step_logits], stream=True)

    def generate(self, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, stop: Sequence[str] | None = None, *, prompt: Sequence[int] | None = None) -> list[int]:
        """Generate up to max_new_tokens after what the session holds; returns the new ids
        (EOS included if hit). They become part of the session."""
        return list(self.generate_stream(max_new_tokens, temperature, top_k, top_p, seed, stop, prompt=prompt))


def _check_generation(model, max_new_tokens: int, sampling: Sampling, stop) -> Sampling:
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if stop and model.tokenizer is None:
        raise ValueError("stop strings need a tokenizer (the model folder has no tokenizer.json)")
    check_stops(stop)
    return sampling


def _run(sessions: list[Session], requested: int, sampling: Sampling, stop, t0: float,
         step_logits: list | None = None, stream: bool = False) -> Iterator[int]:
    """Decode sessions (each holding its prompt fed, with next-token logits) on the
    model's scheduler, one job each, stepping it on this thread until they end. With
    `stream`, yields the first session's tokens as they come; otherwise yields nothing.
    If the generator is closed early, its jobs are cancelled and their rows handed back."""
    from ftjax.engine.scheduler import Job  # the scheduler builds on sessions

    m = sessions[0].model
    scheduler = m.api_scheduler()
    out: collections.deque[int] = collections.deque()
    step_logits = step_logits or [None] * len(sessions)
    jobs = [Job(np.asarray(s._ids, np.int32), requested, sampling, *_callbacks(s, t0, stop, stream and b == 0, out),
                id=f"api-{id(s):x}", session=s, step_logits=step_logits[b]) for b, s in enumerate(sessions)]
    for job in jobs:
        scheduler.submit(job)

    def note_reshapes():
        for s, job in zip(sessions, jobs):
            s.last_generation.reshape_steps, s.last_generation.reshape_s = job.reshape_steps, job.reshape_s

    first = stream  # streaming: the first token is yielded before the next decode step runs
    try:
        while any(j.outcome is None for j in jobs):
            with scheduler.lock:
                scheduler.step(decode_unless=lambda: first and bool(out))
            first = first and not out
            note_reshapes()
            while out:
                yield out.popleft()
    finally:
        if any(j.outcome is None for j in jobs):  # closed early: cancelled rows leave within a step
            for j in jobs:
                scheduler.cancel(j)
            while any(j.outcome is None for j in jobs):
                with scheduler.lock:
                    scheduler.step()
        note_reshapes()
        for s in sessions:
            g = s.last_generation
            spent = dict(decode_s=g.decode_s, decode_tokens=max(g.new_tokens - 1, 0))
            s.timing.add(**spent)
    failed = next((j for j in jobs if j.outcome.startswith("error")), None)
    if failed is not None:
        raise failed.error if failed.error is not None else RuntimeError(failed.outcome)
    while out:
        yield out.popleft()


def _callbacks(session: Session, t0: float, stop, stream: bool, out: collections.deque):
    """A job's on_token / on_done for a session: tokens join the session (and `out` when
    streaming), its GenerationStats follow, stop strings are matched incrementally."""
    g = session.last_generation
    matcher = StopMatcher(session.model.tokenizer, stop) if stop else None

    def on_token(tok: int) -> bool:
        now = time.perf_counter()
        session._ids.append(tok)
        g.new_tokens += 1
        if g.new_tokens == 1:
            g.ttft_s = now - t0
        first = t0 + g.ttft_s  # when the first token came
        if g.new_tokens == 2:
            g.first_step_s = now - first
        g.decode_s = now - first
        if stream:
            out.append(tok)
        return matcher is not None and matcher.push(tok) is not None

    def on_done(reason: str) -> None:
        g.stop_reason = reason

    return on_token, on_done


def generate_batch(sessions: list[Session], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0, seed: int = 0, stop: Sequence[str] | None = None) -> list[list[int]]:
    """Continue several sessions together, one batched decode step per token; each
    session gets its own new tokens (as its own `generate` would produce them)."""
    if not sessions:
        return []
    m = sessions[0].model
    if any(s.model is not m for s in sessions) or len({id(s) for s in sessions}) != len(sessions):
        raise ValueError("generate_batch needs distinct sessions of one model")
    sampling = _check_generation(m, max_new_tokens, Sampling(temperature, top_k, top_p, seed), stop)
    if any(not s._ids for s in sessions):
        raise ValueError("every session needs a prompt before generate_batch")
    starts = [s.position for s in sessions]
    for s in sessions:
        s.last_generation = GenerationStats()
        if max_new_tokens:
            s._flush()  # rows decode together from stored logits
    budgets = [min(max_new_tokens, m.max_seq_len - s.position) for s in sessions]
    for s, n in zip(sessions, budgets):
        if max_new_tokens and n <= 0:
            s.last_generation.stop_reason = "context"
    live = [s for s, n in zip(sessions, budgets) if n > 0]
    if live:
        for _ in _run(live, max_new_tokens, sampling, stop, time.perf_counter()):
            pass
    return [s._ids[start:] for s, start in zip(sessions, starts)]
