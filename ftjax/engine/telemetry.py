"""Expert-placement telemetry with bounded memory.

Every step returns `codes [Lm, E]` int8 (0 unused, 1 hit, 2 fetched, 3 host, 4 streamed;
see `ftjax.experts.executor`). The step never waits for them: they stay device arrays
in a short pending list and are folded on the host in batches of `FOLD_EVERY`, or when
asked for. Folding adds them to cumulative counters (O(1) memory for the life of the
model) and keeps the last `keep_records` steps in a ring for `Model.expert_log()`
(0 keeps none; None keeps every step, for offline studies).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import jax
import numpy as np

FOLD_EVERY = 64
DEFAULT_KEEP_RECORDS = 8192


@dataclass
class Record:
    phase: str  # "prefill" | "decode"
    step: int
    codes: np.ndarray  # [Lm, E] int8


@dataclass
class Timing:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    bytes_streamed: int = 0

    def add(self, prefill_s: float = 0.0, prefill_tokens: int = 0, decode_s: float = 0.0,
            decode_tokens: int = 0) -> None:
        self.prefill_s += prefill_s
        self.prefill_tokens += prefill_tokens
        self.decode_s += decode_s
        self.decode_tokens += decode_tokens


@dataclass
class Telemetry:
    keep_records: int | None = DEFAULT_KEEP_RECORDS
    by_expert: np.ndarray | None = None  # [5, E] counts by code and expert (summed over layers); None before a step
    timing: Timing = field(default_factory=Timing)
    step: int = 0
    dropped: int = 0  # records that fell out of the ring
    failed_steps: int = 0  # steps whose codes never came (the step failed)
    _pending: list = field(default_factory=list)
    _ring: collections.deque = field(default=None)

    def __post_init__(self):
        if self.keep_records is not None and self.keep_records < 0:
            raise ValueError(f"keep_records must be >= 0 or None, got {self.keep_records}")
        self._ring = collections.deque(maxlen=self.keep_records)

    def record(self, phase: str, codes: jax.Array) -> None:
        self.step += 1
        self._pending.append((phase, self.step, codes))
        if len(self._pending) >= FOLD_EVERY:
            self.fold()

    def fold(self) -> None:
        if not self._pending:
            return
        try:
            host = jax.device_get([c for _, _, c in self._pending])
        except Exception:  # a failed step's codes carry its error: fold the others, drop those
            host = [_readable(c) for _, _, c in self._pending]
        folded = []
        for (phase, step, _), codes in zip(self._pending, host):
            if codes is None:
                self.failed_steps += 1
                continue
            codes = np.asarray(codes)
            folded.append(codes)
            if self.keep_records != 0:
                if self._ring.maxlen is not None and len(self._ring) == self._ring.maxlen:
                    self.dropped += 1
                self._ring.append(Record(phase, step, codes))
            else:
                self.dropped += 1
        if folded:  # one count over the fold's steps: codes [P, Lm, E] -> [5, E]
            stacked = np.stack(folded)
            per_expert = np.stack([np.sum(stacked == c, axis=(0, 1), dtype=np.int64) for c in range(5)])
            self.by_expert = per_expert if self.by_expert is None else self.by_expert + per_expert
        self._pending.clear()

    def records(self) -> list[Record]:
        self.fold()
        return list(self._ring)

    def totals(self) -> np.ndarray:
        """[5] counts by code."""
        by_expert = self.totals_by_expert()
        return by_expert.sum(axis=1) if by_expert is not None else np.zeros(5, np.int64)

    def totals_by_expert(self) -> np.ndarray | None:
        """[5, E] counts by code and expert (None before any step)."""
        self.fold()
        return self.by_expert

    def reset(self) -> None:
        self._pending.clear()
        self._ring.clear()
        self.by_expert = None
        self.timing = Timing()
        self.step = self.dropped = self.failed_steps = 0


def _readable(codes: jax.Array) -> np.ndarray | None:
    try:
        return np.asarray(codes)
    except Exception:
        return None
