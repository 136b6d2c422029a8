"""The expert-cache engine: replays a routing trace against a slot table.

One engine, strategies as data. The device cache is a table of `slots` slots, each
holding one global expert id g = layer * E + expert or -1 (empty). Per record
(one MoE layer of one step) with U = its sorted unique selected experts:

    hits   = U that are resident            misses = U \\ resident, m = |misses|
    q      = min(fetch_rule(m), capacity - |hits|)
    fetch  = the q misses the score values most (ties: lower id); the rest run on host
    for each fetched expert, in the score's insertion order (default: ascending id):
        take the lowest free slot of the layer's slot range, else evict the resident
        expert of that range with the lowest score key that is NOT in U
        (ties: lower global id); a score may refuse admission (-> host)
    score.touch(U)  # hits, fetched and host alike

Two strategies plug in:
  * `fetch_rule(m) -> q`: how many misses to transfer (the bandwidth split, or m
    for transfer-only, or 0 for host-only); see `ftjax.lab.lru`.
  * a `Score`: per-expert keys (lower = evicted first, higher = fetched first),
    which may depend on the record being served (`victim_keys`, `fetch_keys`),
    and how they change on use (`touch`); see `ftjax.lab.policies`.

"Capacity" is the whole table for a global cache, or the layer's own contiguous
slot range for a partitioned (per-layer) cache. Global LRU with these rules is the
reference the jitted runtime is tested against (`ftjax.lab.lru.simulate_lru`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import numpy as np

from ftjax.lab.trace import Trace

FetchRule = Callable[[int], int]


class Score:
    """Base eviction/fetch strategy over global expert ids.

    `key` [N] float: lower is evicted first; among misses, higher is fetched first.
    Subclasses update `key` in `touch` (called once per record, after placement).
    """

    def __init__(self, trace: Trace):
        self.num_experts = trace.num_experts
        self.key = np.zeros(trace.num_layers * trace.num_experts, np.float64)

    def victim_keys(self, i: int, ids: np.ndarray) -> np.ndarray:
        """Keys of the resident experts `ids` when record i needs a victim."""
        return self.key[ids]

    def fetch_keys(self, i: int, ids: np.ndarray) -> np.ndarray:
        """Value of the missed experts `ids` of record i when choosing which to fetch."""
        return self.key[ids]

    def insertion_order(self, i: int, ids: np.ndarray) -> np.ndarray:
        """The order in which the chosen misses claim slots (runtime: ascending id)."""
        return ids

    def admits(self, i: int, new_id: int, victim_id: int) -> bool:
        """Whether `new_id` may displace `victim_id` (demand policies: always)."""
        return True

    def touch(self, i: int, ids: np.ndarray) -> None:
        raise NotImplementedError


class CacheStep(NamedTuple):
    """What one record did. Expert ids are within-layer ids, ascending."""

    step: int
    layer: int
    phase: str
    hits: tuple[int, ...]
    fetched: tuple[int, ...]
    host: tuple[int, ...]
    fetched_slots: tuple[int, ...]  # slot taken by fetched[j]
    evicted: tuple[tuple[int, int] | None, ...]  # (layer, expert) displaced by fetched[j]


@dataclasses.dataclass
class CacheResult:
    """Per-record outcomes plus the final slot table of one replay."""

    num_layers: int
    num_experts: int
    slots: int
    steps: list[CacheStep]
    final_slot_table: np.ndarray  # [slots] global id or -1
    initial_slot_table: np.ndarray  # [slots] global id or -1

    def _counts(self, phase: str | None):
        sel = [s for s in self.steps if phase is None or s.phase == phase]
        hits = sum(len(s.hits) for s in sel)
        fetched = sum(len(s.fetched) for s in sel)
        host = sum(len(s.host) for s in sel)
        return hits, fetched, host

    def totals(self, phase: str | None = None) -> dict[str, int]:
        """selections, hits, misses, fetched, host_computed (over one phase or all)."""
        hits, fetched, host = self._counts(phase)
        return {
            "selections": hits + fetched + host,
            "hits": hits,
            "misses": fetched + host,
            "fetched": fetched,
            "host_computed": host,
        }

    def miss_rate(self, phase: str | None = None) -> float:
        t = self.totals(phase)
        return t["misses"] / t["selections"] if t["selections"] else 0.0

    @property
    def selections(self) -> int:
        return self.totals()["selections"]

    @property
    def hits(self) -> int:
        return self.totals()["hits"]

    @property
    def misses(self) -> int:
        return self.totals()["misses"]

    @property
    def fetched(self) -> int:
        return self.totals()["fetched"]

    @property
    def host_computed(self) -> int:
        return self.totals()["host_computed"]

    def slot_table_after(self, i: int) -> np.ndarray:
        """Slot table [slots] (global id or -1) after record i, replayed from the log."""
        table = self.initial_slot_table.copy()
        for s in self.steps[: i + 1]:
            for expert, slot in zip(s.fetched, s.fetched_slots):
                table[slot] = s.layer * self.num_experts + expert
        return table

    def slot_owners(self, table: np.ndarray) -> np.ndarray:
        """[slots, 2] (layer, expert) per slot, (-1, -1) for an empty slot."""
        table = np.asarray(table)
        owners = np.stack([table // self.num_experts, table % self.num_experts], axis=1)
        owners[table < 0] = -1
        return owners


def global_ranges(num_layers: int, slots: int) -> list[tuple[int, int]]:
    """Every layer may use every slot."""
    return [(0, slots)] * num_layers


def per_layer_ranges(num_layers: int, slots: int) -> list[tuple[int, int]]:
    """Contiguous private ranges of slots // L each; the first slots % L layers get one more."""
    base, extra = divmod(slots, num_layers)
    sizes = [base + (layer < extra) for layer in range(num_layers)]
    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return [(starts[l], starts[l + 1]) for l in range(num_layers)]


def _most_valuable(ids: np.ndarray, keys: np.ndarray, q: int) -> np.ndarray:
    """The q ids with the highest keys, ties to the lower id; returned ascending."""
    order = np.lexsort((ids, -keys))
    return np.sort(ids[order[:q]])


def _lowest_key(keys: np.ndarray, ids: np.ndarray) -> int:
    """Index of the lowest key, ties to the lower id."""
    candidates = np.flatnonzero(keys == keys.min())
    return int(candidates[np.argmin(ids[candidates])])


def _place(i, chosen, hit_slots, lo, hi, table, score) -> list[tuple[int, int, int]]:
    """Give each chosen miss a slot of [lo, hi): lowest free, else evict a victim.

    Victims: the lowest score key among residents of the range not in U, i.e. not a
    hit (`hit_slots`) and not a newcomer of this record. Keys are read once per
    record (scores only change in `touch`); protected slots get key +inf.
    Returns (global id, slot, victim or -1) per placed expert.
    """
    view = table[lo:hi]
    free = (lo + np.flatnonzero(view < 0)).tolist()
    keys = None
    placed = []
    for g in score.insertion_order(i, chosen).tolist():
        victim = -1
        if free:
            slot = free.pop(0)
        else:
            if keys is None:
                keys = score.victim_keys(i, view).astype(np.float64)
                keys[hit_slots - lo] = np.inf
                keys[[slot - lo for _, slot, _ in placed]] = np.inf
            offset = _lowest_key(keys, view)
            if keys[offset] == np.inf:
                raise RuntimeError("no evictable slot: the capacity clamp failed")
            slot, victim = lo + offset, int(view[offset])
            if not score.admits(i, g, victim):
                continue
            keys[offset] = np.inf
        table[slot] = g
        placed.append((g, slot, victim))
    return placed


def run_cache(
    trace: Trace,
    slots: int,
    score: Score,
    fetch_rule: FetchRule,
    ranges: Sequence[tuple[int, int]] | None = None,
    initial_slot_table: np.ndarray | None = None,
) -> CacheResult:
    """Replay `trace` on a cache of `slots` slots; see the module docstring for the rules.

    ranges[layer] = (lo, hi): the slots that layer may use (default: all of them).
    initial_slot_table: optional warm start [slots] of global ids (-1 = empty).
    """
    num_experts = trace.num_experts
    ranges = list(ranges or global_ranges(trace.num_layers, slots))
    table = np.full(slots, -1, np.int64)  # [slots] global id or -1
    if initial_slot_table is not None:
        table[:] = initial_slot_table
    start_table = table.copy()
    slot_of = np.full(trace.num_layers * num_experts, -1, np.int64)  # inverse of table
    slot_of[table[table >= 0]] = np.flatnonzero(table >= 0)

    steps = []
    for i, (step, layer, phase, experts) in enumerate(trace.rows()):
        base = layer * num_experts
        ids = base + experts
        lo, hi = ranges[layer]
        resident = slot_of[ids] >= 0
        hits, misses = ids[resident], ids[~resident]

        q = max(0, min(fetch_rule(len(misses)), (hi - lo) - len(hits)))
        chosen = _most_valuable(misses, score.fetch_keys(i, misses), q)
        placed = sorted(_place(i, chosen, slot_of[hits], lo, hi, table, score))  # by id
        for g, slot, victim in placed:
            if victim >= 0:
                slot_of[victim] = -1
            slot_of[g] = slot

        fetched = {g for g, _, _ in placed}
        steps.append(
            CacheStep(
                step=step,
                layer=layer,
                phase=phase,
                hits=tuple((hits - base).tolist()),
                fetched=tuple(g - base for g, _, _ in placed),
                host=tuple(g - base for g in misses.tolist() if g not in fetched),
                fetched_slots=tuple(slot for _, slot, _ in placed),
                evicted=tuple(
                    divmod(victim, num_experts) if victim >= 0 else None
                    for _, _, victim in placed
                ),
            )
        )
        score.touch(i, ids)

    return CacheResult(
        num_layers=trace.num_layers,
        num_experts=num_experts,
        slots=slots,
        steps=steps,
        final_slot_table=table,
        initial_slot_table=start_table,
    )
