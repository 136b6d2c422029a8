"""Placement policies as data.

A policy says two things: which experts are resident on the device before the first
token (`initial`), and how many of a record's m cache misses are transferred to the
device rather than computed on the host (`split`). The executor implements one
mechanism (slot table + LRU stamps, see `executor.py`) and every named policy is a row
of `POLICIES`:

| name               | initial residency              | misses transferred (q)      |
|--------------------|--------------------------------|-----------------------------|
| device             | every expert (no cache)        | - (nothing ever misses)     |
| host               | none, no slots                 | 0                           |
| lru                | empty                          | q* from B_P/B_H (below)     |
| lru-transfer-only  | empty                          | m                           |
| lru-host-only      | empty                          | 0                           |
| static-frequency   | most-selected experts, pinned  | 0                           |
| static-layer       | all experts of the first layers| 0                           |

The q* rule (the paper's bandwidth-adaptive split): r = min(1, B_P / B_H); q is
floor(m*r) or ceil(m*r), whichever gives the smaller max(q*(1-r), (m-q)*r) (the time
the slower of the two paths takes, in units of S/B_H), ties to the smaller q.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Policy:
    name: str
    initial: str  # "all" | "empty" | "frequency" | "layer"
    split: str  # "adaptive" | "transfer" | "host" | "none"
    uses_slots: bool = True


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in [
        Policy("device", initial="all", split="none", uses_slots=False),
        Policy("host", initial="empty", split="host", uses_slots=False),
        Policy("lru", initial="empty", split="adaptive"),
        Policy("lru-transfer-only", initial="empty", split="transfer"),
        Policy("lru-host-only", initial="empty", split="host"),
        Policy("static-frequency", initial="frequency", split="host"),
        Policy("static-layer", initial="layer", split="host"),
    ]
}


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]


def transfer_ratio(b_p_gbps: float, b_h_gbps: float) -> float:
    """r = min(1, B_P / B_H): the share of misses worth sending over the link."""
    if b_p_gbps <= 0 or b_h_gbps <= 0:
        raise ValueError(f"bandwidths must be positive, got B_P={b_p_gbps} B_H={b_h_gbps}")
    return min(1.0, b_p_gbps / b_h_gbps)


def adaptive_q(m: int, r: float) -> int:
    """The q* rule: floor or ceil of m*r, whichever balances the two paths better."""
    lo, hi = math.floor(m * r), math.ceil(m * r)
    cost = lambda q: max(q * (1.0 - r), (m - q) * r)  # noqa: E731
    return hi if cost(hi) < cost(lo) else lo


def q_table(policy: Policy, max_misses: int, r: float) -> np.ndarray:
    """q for every miss count 0..max_misses (before the free-slot cap), as int32."""
    if policy.split == "adaptive":
        q = [adaptive_q(m, r) for m in range(max_misses + 1)]
    elif policy.split == "transfer":
        q = list(range(max_misses + 1))
    else:
        q = [0] * (max_misses + 1)
    return np.asarray(q, dtype=np.int32)


def static_residents(policy: Policy, slots: int, num_layers: int, num_experts: int,
                     frequency: np.ndarray | None = None) -> np.ndarray:
    """Global expert ids (layer*E + expert) resident from the start, at most `slots`.

    frequency [Lm, E]: selection counts of a profiling run (static-frequency). The
    most selected experts win; ties go to the lower (layer, expert).
    """
    total = num_layers * num_experts
    if policy.initial == "layer":
        return np.arange(min(slots // num_experts, num_layers) * num_experts, dtype=np.int32)
    if policy.initial == "frequency":
        if frequency is None:
            raise ValueError("static-frequency needs selection counts from a profiling run (frequency=[Lm, E])")
        counts = np.asarray(frequency, dtype=np.int64).reshape(total)
        order = np.lexsort((np.arange(total), -counts))  # most selected first, then lower id
        return np.sort(order[: min(slots, total)]).astype(np.int32)
    return np.zeros(0, dtype=np.int32)
