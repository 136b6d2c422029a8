"""The runtime's global-LRU rules: the reference the jitted decode step must match.

Rules, per record (one MoE layer of one step), with U = the sorted unique selected
experts (global ids g = layer * E + expert) and a counter t that increments once
per record (the first record has t = 1):

 1. hits = U that are resident; misses = the rest; m = |misses|.
 2. q: with r = min(1, B_P / B_H),
      `lru`               q = floor(m r) or ceil(m r), whichever gives the smaller
                          max(q (1 - r), (m - q) r); ties to the smaller q.
                          (T_fill ~ q S / B_P and T_cpu ~ (m - q) S / (B_H - B_P),
                          both scaled by B_P (B_H - B_P) / (S B_H).)
      `lru-transfer-only` q = m          `lru-host-only`   q = 0
    then q = min(q, slots - |hits|).
 3. fetched = the q misses with the most recent last-use stamp (never used = 0 =
    oldest), ties to the lower expert id; host = the other misses.
 4. each fetched expert, in ascending id order, takes the lowest free slot, else
    evicts the resident expert (any layer) with the oldest stamp that is not in U,
    ties to the lower (layer, expert); the victim's slot is reused.
 5. every expert of U gets stamp t (hits, fetched and host alike).

`simulate_lru` runs exactly these rules through the shared engine (`cache.run_cache`
with `LruScore`, key = last-use stamp). For bit-exact agreement the runtime should
take q from `fetch_count_table` (computed here in float64 once per bandwidth pair)
rather than recomputing floor/ceil in float32 on the device.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ftjax.experts.policy import adaptive_q
from ftjax.lab.cache import CacheResult, FetchRule, Score, run_cache
from ftjax.lab.trace import Trace

LruResult = CacheResult  # the result type of simulate_lru

LRU_POLICIES = ("lru", "lru-transfer-only", "lru-host-only")


def fetch_count(m: int, ratio: float) -> int:
    """q for m misses at ratio r = B_P / B_H (clamped to [0, 1]); see rule 2. The same
    function the runtime tabulates (`ftjax.experts.policy.adaptive_q`)."""
    return adaptive_q(m, min(1.0, max(0.0, float(ratio))))


def fetch_rule(policy: str, bandwidth: tuple[float, float] | None = None) -> FetchRule:
    """m -> q for one of LRU_POLICIES; `bandwidth` = (B_P, B_H) is needed for `lru`."""
    if policy == "lru-transfer-only":
        return lambda m: m
    if policy == "lru-host-only":
        return lambda m: 0
    if policy == "lru":
        if bandwidth is None:
            raise ValueError("policy 'lru' needs bandwidth=(b_p, b_h)")
        b_p, b_h = bandwidth
        ratio = b_p / b_h
        return lambda m: fetch_count(m, ratio)
    raise ValueError(f"unknown LRU policy {policy!r}; expected one of {LRU_POLICIES}")


def fetch_count_table(
    max_misses: int, policy: str = "lru", bandwidth: tuple[float, float] | None = None
) -> np.ndarray:
    """q for m = 0..max_misses, as int32 [max_misses + 1] (the runtime's lookup table)."""
    rule = fetch_rule(policy, bandwidth)
    return np.array([rule(m) for m in range(max_misses + 1)], np.int32)


class LruScore(Score):
    """key = last-use stamp t (record counter, 1-based; never used = 0)."""

    def touch(self, i: int, ids: np.ndarray) -> None:
        self.key[ids] = i + 1


def simulate_lru(
    trace: Trace,
    slots: int,
    policy: str = "lru",
    bandwidth: tuple[float, float] | None = None,
) -> LruResult:
    """Replay the runtime's global LRU on every record of `trace` (filter it first).

    policy: "lru" (bandwidth split, needs bandwidth=(b_p, b_h)), "lru-transfer-only"
    or "lru-host-only". Returns per-record hits/fetched/host/slots and the totals.
    """
    return run_cache(trace, slots, LruScore(trace), fetch_rule(policy, bandwidth))


def first_mismatch(result: CacheResult, records: Sequence[Mapping[str, Any]]) -> str | None:
    """Compare runtime log records ("hits", "fetched", "host") with a replay.

    Returns None when every record agrees, else a message naming the first
    difference. Fields missing from a runtime record are not compared.
    """
    if len(records) != len(result.steps):
        return f"record count differs: runtime {len(records)} vs lab {len(result.steps)}"
    for i, (rec, step) in enumerate(zip(records, result.steps)):
        for field in ("hits", "fetched", "host"):
            if field in rec and sorted(rec[field]) != list(getattr(step, field)):
                return (
                    f"record {i} (step {step.step}, layer {step.layer}): {field} "
                    f"runtime {sorted(rec[field])} vs lab {list(getattr(step, field))}"
                )
    return None
