"""Online bandwidth calibration: B_H (and B_P where a transfer can be timed) re-estimated
from what the running model does, and the q table swapped into the executor as data.

The profile (`profile.py`) measures B_P and B_H once, on a quiet machine. Under serving
the host kernels share their cores with everything else on the box (the server, the
tokenizer, other processes), and a profile measured in isolation can be far off — a
FreeToken user measured 28x (their issue #151). When the host path runs below its
profile, the split should move toward transfers (r = min(1, B_P/B_H) grows), and back
when the load goes away. So the model keeps moving averages of what it observes:

- B_H: the host expert kernel's own account (`HostExecutor.work_done`: calls, seconds
  inside the kernel, distinct experts read; written by the C++ handler at the end of
  every call, or by the callback path). Bytes = experts x one expert's bytes (in the
  pool's format: q8_0 experts count their own, smaller, bytes).
- B_P: transfers the runtime can time apart from compute (`observe_transfer`). A decode
  step's fetches run inside the jitted step, fused with the rest of it, so decode alone
  gives no B_P sample; without samples B_P stays at the profile's value (`stats()` says
  which it is).

Observations are pooled until they cover `min_bytes` (a single small call's timer noise
must not swing q), then folded into an exponential moving average with weight `alpha`.
A step with no host work gives no B_H sample — and once a slow host has pushed r to 1,
every miss is transferred and the host gets no work at all. So each poll without host
work relaxes B_H a step (`relax`) back toward the profile: q drops again, the host gets
work, and its samples confirm the slowdown (q goes back up) or show it has passed.
After each fold r is recomputed and, when the q table of the new r differs from the one
in force, `poll` returns it; the model swaps it into the executor state (same shape and
dtype: the steps are not recompiled).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ftjax.experts.policy import Policy, q_table, transfer_ratio


@dataclass
class _Average:
    """An exponential moving average of a rate (bytes / second), fed in pooled samples."""

    value: float  # GB/s
    alpha: float
    min_bytes: int
    samples: int = 0
    pending_bytes: int = 0
    pending_s: float = 0.0

    def relax(self, target: float, weight: float) -> None:
        self.value += weight * (target - self.value)
        if abs(self.value - target) < 1e-3 * target:
            self.value = target

    def add(self, nbytes: int, seconds: float) -> bool:
        """Pool a sample; fold the pool once it covers min_bytes. -> whether it folded."""
        if nbytes <= 0 or seconds <= 0:
            return False
        self.pending_bytes += nbytes
        self.pending_s += seconds
        if self.pending_bytes < self.min_bytes:
            return False
        rate = self.pending_bytes / self.pending_s / 1e9
        self.value = rate if self.samples == 0 else (1 - self.alpha) * self.value + self.alpha * rate
        self.samples += 1
        self.pending_bytes, self.pending_s = 0, 0.0
        return True


@dataclass
class Calibration:
    """Live (B_P, B_H) for one model, starting from its profile (GB/s)."""

    profile: tuple[float, float]  # (B_P, B_H) the model was loaded with
    expert_bytes: int  # bytes of one expert in the pool's format
    policy: Policy  # whose q rule turns r into the table
    num_experts: int
    alpha: float = 0.3
    min_bytes: int = 4 << 20
    relax: float = 0.02  # per poll without host work, B_H moves this share back to the profile
    _b_p: _Average = field(init=False)
    _b_h: _Average = field(init=False)
    q_table: np.ndarray = field(init=False)  # [E+1] int32: the table in force (the executor state's)
    _seen: tuple[int, float, int] = field(init=False, default=(0, 0.0, 0))

    def __post_init__(self):
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        transfer_ratio(*self.profile)  # validates both bandwidths
        self._b_p = _Average(self.profile[0], self.alpha, self.min_bytes)
        self._b_h = _Average(self.profile[1], self.alpha, self.min_bytes)
        self.q_table = q_table(self.policy, self.num_experts, self.ratio)

    @property
    def bandwidth(self) -> tuple[float, float]:
        """The live (B_P, B_H) in GB/s (the profile's until samples arrive)."""
        return self._b_p.value, self._b_h.value

    @property
    def ratio(self) -> float:
        return transfer_ratio(*self.bandwidth)

    def observe_transfer(self, nbytes: int, seconds: float) -> bool:
        return self._b_p.add(nbytes, seconds)

    def observe_host(self, nbytes: int, seconds: float) -> bool:
        return self._b_h.add(nbytes, seconds)

    def poll(self, work_done: tuple[int, float, int]) -> np.ndarray | None:
        """Fold the host work done since the last poll (`HostExecutor.work_done()`, which is
        cumulative). -> the new q table [E+1] when the split changed, else None."""
        calls, seconds, experts = work_done
        seen_calls, seen_s, seen_experts = self._seen
        self._seen = work_done
        if calls == seen_calls:  # no host work since the last poll
            if self._b_h.value == self.profile[1]:
                return None
            self._b_h.relax(self.profile[1], self.relax)
        elif not self.observe_host((experts - seen_experts) * self.expert_bytes, seconds - seen_s):
            return None
        table = q_table(self.policy, self.num_experts, self.ratio)
        if np.array_equal(table, self.q_table):
            return None
        self.q_table = table
        return table

    def stats(self) -> dict:
        b_p, b_h = self.bandwidth
        return {"profile_gbps": {"B_P": self.profile[0], "B_H": self.profile[1]},
                "live_gbps": {"B_P": b_p, "B_H": b_h},
                "samples": {"B_P": self._b_p.samples, "B_H": self._b_h.samples},
                "B_P_source": "observed" if self._b_p.samples else "profile",
                "transfer_ratio": self.ratio, "q_table": self.q_table.tolist()}
