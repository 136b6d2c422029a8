"""Tests for the offline cache lab: traces, the runtime's LRU rules, policies, report files.

Hand-made traces with answers worked out by hand, a literal second implementation
of the LRU rules, and Belady checked against a brute-force optimum.
"""

import itertools
import json
import math

import numpy as np
import pytest

from ftjax.lab import (
    OUR_POLICY,
    POLICIES,
    Trace,
    fetch_count,
    fetch_count_table,
    first_mismatch,
    miss_rate_curve,
    run_policy,
    simulate_lru,
    synthetic_trace,
)
from ftjax.lab.report import (
    check_cache_policies_json,
    markdown_table,
    miss_rate_table,
    plot_miss_rates,
    write_cache_policies_json,
)


def make_trace(num_layers, num_experts, rows, phase="decode"):
    """rows: [(layer, [experts]), ...] in execution order; step = index // num_layers."""
    records = [
        {"step": i // num_layers, "layer": layer, "phase": phase, "selected": sel}
        for i, (layer, sel) in enumerate(rows)
    ]
    return Trace.from_records(records, num_layers, num_experts)


def random_trace(rng, num_layers, num_experts, num_records):
    records = [
        {
            "step": i,
            "layer": int(rng.integers(num_layers)),
            "phase": "decode",
            "selected": rng.choice(num_experts, int(rng.integers(1, num_experts + 1)), replace=False),
        }
        for i in range(num_records)
    ]
    return Trace.from_records(records, num_layers, num_experts)


# -- trace -----------------------------------------------------------------------------


def test_trace_round_trip(tmp_path):
    records = [
        {"step": 0, "layer": 0, "phase": "prefill", "selected": [3, 1, 2, 1], "hits": [1]},
        {"step": 0, "layer": 1, "phase": "prefill", "selected": [0, 1, 2, 3]},
        {"step": 1, "layer": 0, "phase": "decode", "selected": [2], "fetched": [2], "host": []},
        {"step": 1, "layer": 1, "phase": "decode", "selected": []},
    ]
    trace = Trace.from_records(records, 2, 4, {"model": "toy", "top_k": 2})
    assert len(trace) == 4 and trace.num_selections == 8
    assert trace.records()[0] == {"step": 0, "layer": 0, "phase": "prefill", "selected": [1, 2, 3]}
    trace.save(tmp_path / "t.npz")
    loaded = Trace.load(tmp_path / "t.npz")
    assert loaded.records() == trace.records()
    assert loaded.meta == {"model": "toy", "top_k": 2}
    assert (loaded.num_layers, loaded.num_experts) == (2, 4)
    assert [r["step"] for r in loaded.decode_only().records()] == [1, 1]
    assert loaded.filter("prefill").records() == trace.records()[:2]
    assert trace.flat_ids().tolist() == [1, 2, 3, 4, 5, 6, 7, 2]


def test_trace_rejects_bad_ids():
    with pytest.raises(ValueError):
        Trace.from_records([{"step": 0, "layer": 2, "selected": [0]}], 2, 4)
    with pytest.raises(ValueError):
        Trace.from_records([{"step": 0, "layer": 0, "selected": [4]}], 2, 4)


def test_synthetic_trace_shape_and_locality():
    loose = synthetic_trace(4, 16, 3, 200, 0.0, seed=1)
    sticky = synthetic_trace(4, 16, 3, 200, 0.9, seed=1)
    assert len(loose) == 800 and all(len(r["selected"]) == 3 for r in loose.records())

    def reuse(trace):
        recs = trace.records()
        return np.mean([len(set(a["selected"]) & set(b["selected"])) for a, b in zip(recs, recs[4:])])

    assert reuse(sticky) > 2.5 > 1.5 > reuse(loose)  # popularity alone repeats ~1 of 3
    warm = synthetic_trace(4, 16, 3, 10, 0.5, seed=1, prefill_tokens=50)
    assert len(warm.filter("prefill")) == 4 and len(warm.decode_only()) == 40


# -- the q rule ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "m, ratio, q",
    [
        (4, 0.25, 1),  # the paper's example
        (3, 0.5, 1),  # 1.5: cost 1.0 both ways -> the smaller q
        (5, 0.3, 1),  # 1.5: max(.7, 1.2) < max(1.4, .9)
        (5, 0.7, 4),  # 3.5: max(1.2, .7) < max(.9, 1.4)
        (1, 0.5, 0),  # tie -> 0
        (7, 49.0 / 53.8, 7),  # RTX 5090 desktop
        (8, 11.8 / 47.5, 2),  # RTX 4060 laptop: 1.99 -> 2
        (6, 25.1 / 63.2, 2),  # RTX 4090: 2.38 -> 2
        (0, 0.4, 0),
        (10, 1.7, 10),  # B_P > B_H clamps r to 1
        (10, 0.0, 0),
    ],
)
def test_fetch_count_cases(m, ratio, q):
    assert fetch_count(m, ratio) == q


def test_fetch_count_is_the_argmin_of_the_balance():
    rng = np.random.default_rng(0)
    for _ in range(500):
        m, r = int(rng.integers(0, 40)), float(rng.random())
        costs = [max(q * (1 - r), (m - q) * r) for q in range(m + 1)]
        best = min(costs)
        expected = min(q for q in range(m + 1) if math.isclose(costs[q], best, abs_tol=1e-12))
        assert fetch_count(m, r) == expected


def test_fetch_count_table():
    assert fetch_count_table(5, "lru", (1.0, 4.0)).tolist() == [0, 0, 0, 0, 1, 1]  # m=3: .75 vs .75 -> 0
    assert fetch_count_table(3, "lru-transfer-only").tolist() == [0, 1, 2, 3]
    assert fetch_count_table(3, "lru-host-only").tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError):
        fetch_count_table(3, "lru")


# -- the runtime's LRU rules, by hand ------------------------------------------------------

# 2 MoE layers x 4 experts, 3 slots, B_P / B_H = 0.5 (q = 1 for m = 2, 3; 0 for m = 1)
HAND_ROWS = [
    (0, [0, 1, 2]), (1, [0, 3]), (0, [1, 2, 3]), (1, [0, 1, 2, 3]), (0, [0, 1]), (0, [2, 3]), (1, [1, 2, 3]),
]
HAND_EXPECTED = [
    # hits, fetched, host, slots, evicted
    ((), (0,), (1, 2), (0,), (None,)),  # all stamps 0: fetch the lowest id
    ((), (0,), (3,), (1,), (None,)),
    ((), (1,), (2, 3), (2,), (None,)),  # (0,1),(0,2) stamp 1 beat (0,3) stamp 0; tie -> 1
    ((0,), (3,), (1, 2), (0,), ((0, 0),)),  # (1,3) stamp 2 fetched; evict oldest (0,0)
    ((1,), (), (0,), (), ()),  # m = 1 at r = .5: tie -> q = 0
    ((), (2,), (3,), (1,), ((1, 0),)),  # victims (1,0),(1,3) both stamp 4 -> lower pair
    ((3,), (1,), (2,), (2,), ((0, 1),)),  # oldest (1,3) is needed now: evict (0,1) instead
]


def test_lru_by_hand():
    trace = make_trace(2, 4, HAND_ROWS)
    result = simulate_lru(trace, slots=3, policy="lru", bandwidth=(1.0, 2.0))
    got = [(s.hits, s.fetched, s.host, s.fetched_slots, s.evicted) for s in result.steps]
    assert got == HAND_EXPECTED
    assert result.totals() == {"selections": 19, "hits": 3, "misses": 16, "fetched": 6, "host_computed": 10}
    assert result.final_slot_table.tolist() == [7, 2, 5]  # (1,3), (0,2), (1,1)
    assert result.slot_owners(result.final_slot_table).tolist() == [[1, 3], [0, 2], [1, 1]]
    assert result.slot_table_after(2).tolist() == [0, 4, 1]  # (0,0), (1,0), (0,1)
    assert result.slot_table_after(6).tolist() == result.final_slot_table.tolist()
    # the runtime's log compares field by field
    assert first_mismatch(result, trace.records()) is None
    log = [
        dict(r, hits=list(s.hits), fetched=list(s.fetched), host=list(s.host))
        for r, s in zip(trace.records(), result.steps)
    ]
    assert first_mismatch(result, log) is None
    log[3]["fetched"] = [1]
    assert "record 3" in first_mismatch(result, log)


def test_lru_one_slot_transfer_only():
    trace = make_trace(1, 3, [(0, [0]), (0, [0, 1]), (0, [1, 2]), (0, [2])])
    result = simulate_lru(trace, slots=1, policy="lru-transfer-only")
    got = [(s.hits, s.fetched, s.host, s.evicted) for s in result.steps]
    assert got == [
        ((), (0,), (), (None,)),
        ((0,), (), (1,), ()),  # the only slot holds a hit: no room, 1 runs on host
        ((), (1,), (2,), ((0, 0),)),  # room for one: the more recently used miss (1)
        ((), (2,), (), ((0, 1),)),
    ]
    assert result.totals()["hits"] == 1 and result.fetched == 3 and result.host_computed == 2


def test_lru_host_only_never_fills():
    trace = make_trace(2, 4, HAND_ROWS)
    result = simulate_lru(trace, 3, "lru-host-only")
    assert result.fetched == 0 and result.hits == 0 and result.host_computed == 19
    assert result.final_slot_table.tolist() == [-1, -1, -1]


def literal_lru(records, num_experts, slots, ratio):
    """A second, dict-based reading of the runtime's rules (tests only)."""
    stamp, table, out = {}, [None] * slots, []
    for t, rec in enumerate(records, start=1):
        layer = rec["layer"]
        U = [(layer, e) for e in sorted(set(rec["selected"]))]
        resident = set(x for x in table if x is not None)
        hits = [x for x in U if x in resident]
        misses = [x for x in U if x not in resident]
        m = len(misses)
        q = min(fetch_count(m, ratio), slots - len(hits))
        by_recency = sorted(misses, key=lambda x: (-stamp.get(x, 0), x[1]))
        fetched = sorted(by_recency[:q], key=lambda x: x[1])
        for x in fetched:
            if None in table:
                slot = table.index(None)
            else:
                candidates = [(stamp.get(y, 0), y, s) for s, y in enumerate(table) if y not in U]
                slot = min(candidates)[2]
            table[slot] = x
        for x in U:
            stamp[x] = t
        host = [x for x in misses if x not in fetched]
        out.append(([e for _, e in hits], [e for _, e in fetched], [e for _, e in host], list(table)))
    return out


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.9, 1.0])
def test_lru_matches_literal_reading(ratio):
    rng = np.random.default_rng(int(ratio * 100))
    for _ in range(15):
        num_layers, num_experts = int(rng.integers(1, 4)), int(rng.integers(2, 9))
        trace = random_trace(rng, num_layers, num_experts, 60)
        slots = int(rng.integers(1, num_layers * num_experts + 1))
        result = simulate_lru(trace, slots, "lru", (ratio, 1.0))
        expected = literal_lru(trace.records(), num_experts, slots, ratio)
        for i, (step, exp) in enumerate(zip(result.steps, expected)):
            assert (list(step.hits), list(step.fetched), list(step.host)) == exp[:3]
            table = result.slot_table_after(i)
            owners = [None if g < 0 else divmod(int(g), num_experts) for g in table]
            assert owners == exp[3]


def test_lru_runs_100k_records_in_seconds():
    import time

    trace = synthetic_trace(24, 64, 8, 4200, 0.5, seed=0)  # 100,800 records
    start = time.perf_counter()
    result = simulate_lru(trace, 300, "lru", (25.1, 63.2))
    assert time.perf_counter() - start < 20.0
    assert result.selections == trace.num_selections


# -- policies --------------------------------------------------------------------------


def test_registry_names():
    expected = {"lru", "belady", "lru-per-layer", "lfu", "static-frequency", "static-layer", OUR_POLICY}
    assert expected <= set(POLICIES)
    assert POLICIES[OUR_POLICY].kind == "dynamic"
    with pytest.raises(ValueError):
        run_policy("mru", make_trace(1, 2, [(0, [0])]), 1)


def test_static_layer_by_hand():
    rows = [(0, [0]), (1, [1]), (2, [0, 1])] * 2
    result = run_policy("static-layer", make_trace(3, 2, rows), slots=5)
    assert result.final_slot_table.tolist() == [0, 1, 2, 3, -1]  # layers 0 and 1
    assert result.miss_rate() == 0.5 and result.fetched == 0 and result.host_computed == 4


def test_static_frequency_by_hand():
    trace = make_trace(1, 4, [(0, [0, 1]), (0, [0, 2]), (0, [0, 3]), (0, [2]), (0, [1, 2])])
    result = run_policy("static-frequency", trace, slots=2)  # counts 3, 2, 3, 1
    assert result.final_slot_table.tolist() == [0, 2]
    assert result.misses == 3 and result.fetched == 0
    profile = make_trace(1, 4, [(0, [3]), (0, [3]), (0, [1])])
    result = run_policy("static-frequency", trace, slots=2, profile=profile)
    assert result.final_slot_table.tolist() == [1, 3] and result.misses == 6
    tie = run_policy("static-frequency", make_trace(1, 4, [(0, [3, 2, 1])]), slots=2)
    assert tie.final_slot_table.tolist() == [1, 2]  # equal counts: lower ids


def test_lfu_by_hand():
    trace = make_trace(1, 3, [(0, [0]), (0, [0]), (0, [1]), (0, [2]), (0, [1])])
    lfu = run_policy("lfu", trace, slots=2)
    assert [s.evicted for s in lfu.steps] == [(None,), (), (None,), ((0, 1),), ((0, 2),)]
    assert lfu.misses == 4
    assert run_policy("lru", trace, slots=2).misses == 3
    tie = run_policy("lfu", make_trace(1, 3, [(0, [0]), (0, [1]), (0, [2])]), slots=2)
    assert tie.steps[2].evicted == ((0, 0),)  # equal counts: the older one goes


def test_lru_per_layer_partitions():
    rows = [(0, [0]), (0, [1]), (0, [2]), (1, [0])]
    per_layer = run_policy("lru-per-layer", make_trace(2, 3, rows), slots=4)
    assert per_layer.steps[2].evicted == ((0, 0),)  # layer 0 owns slots 0-1 only
    assert per_layer.steps[3].fetched_slots == (2,)
    assert run_policy("lru", make_trace(2, 3, rows), slots=4).steps[2].evicted == (None,)


def test_belady_by_hand():
    trace = make_trace(1, 3, [(0, [0]), (0, [1]), (0, [2]), (0, [0]), (0, [1])])
    belady = run_policy("belady", trace, slots=2)
    assert belady.steps[2].host == (2,) and belady.steps[2].fetched == ()  # never used again: bypass
    assert belady.misses == 3 and run_policy("lru", trace, slots=2).misses == 5
    # equal next use (both needed by record 2): keep the one needed again after that
    tie = make_trace(1, 2, [(0, [0]), (0, [1]), (0, [0, 1]), (0, [1]), (0, [1])])
    belady = run_policy("belady", tie, slots=1)
    assert belady.steps[1].fetched == (1,) and belady.misses == 3


def brute_force_optimum(trace, slots):
    """Fewest misses over every legal cache evolution (hits stay, newcomers replace non-U)."""
    states = {frozenset(): 0}
    for _, layer, _, experts in trace.rows():
        U = frozenset((layer * trace.num_experts + experts).tolist())
        nxt = {}
        for cache, cost in states.items():
            hits, pool = cache & U, list((U - cache) | (cache - U))
            for r in range(min(slots - len(hits), len(pool)) + 1):
                for keep in itertools.combinations(pool, r):
                    state = hits | frozenset(keep)
                    nxt[state] = min(nxt.get(state, 1 << 30), cost + len(U - cache))
        states = nxt
    return min(states.values())


def test_belady_is_the_optimum_on_tiny_traces():
    rng = np.random.default_rng(7)
    for _ in range(60):
        trace = random_trace(rng, int(rng.integers(1, 3)), int(rng.integers(2, 4)), int(rng.integers(1, 10)))
        for slots in range(trace.num_layers * trace.num_experts + 1):
            assert run_policy("belady", trace, slots).misses == brute_force_optimum(trace, slots)


def test_no_policy_beats_belady():
    rng = np.random.default_rng(11)
    for seed in range(24):
        if seed % 2:
            layers, top_k, locality = int(rng.integers(1, 4)), int(rng.integers(1, 5)), float(rng.random())
            trace = synthetic_trace(layers, 8, top_k, 12, locality, seed=seed)
        else:
            trace = random_trace(rng, int(rng.integers(1, 4)), int(rng.integers(2, 7)), 30)
        for slots in range(0, trace.num_layers * trace.num_experts + 1, 2):
            belady = run_policy("belady", trace, slots)
            free_fills = sum(ev is None for s in belady.steps for ev in s.evicted)
            for name, policy in POLICIES.items():
                misses = run_policy(name, trace, slots).misses
                # static policies start with their pins loaded: discount Belady's fills of empty slots
                bound = belady.misses - free_fills if policy.kind == "static" else belady.misses
                assert misses >= bound, (name, seed, slots)


@pytest.mark.parametrize("name", ["lru", "lru-per-layer", "lfu", OUR_POLICY])
def test_online_policies_do_not_see_the_future(name):
    trace = synthetic_trace(3, 8, 2, 40, 0.5, seed=3)
    full = run_policy(name, trace, 6)
    prefix = run_policy(name, trace.subset(np.arange(len(trace)) < 60), 6)
    assert prefix.steps == full.steps[:60]


def test_our_policy_beats_lru_with_locality():
    fractions = (0.05, 0.1, 0.2, 0.3)
    for locality in (0.3, 0.6):
        trace = synthetic_trace(8, 32, 4, 150, locality, seed=5)
        curve = miss_rate_curve(trace, ["lru", OUR_POLICY], fractions)
        lru = sum(r["miss_rate"] for r in curve if r["policy"] == "lru")
        ours = sum(r["miss_rate"] for r in curve if r["policy"] == OUR_POLICY)
        assert ours < 0.9 * lru, (locality, ours, lru)
        for f in fractions:
            rate = {r["policy"]: r["miss_rate"] for r in curve if r["cache_fraction"] == f}
            assert rate[OUR_POLICY] <= rate["lru"] + 0.01


def test_miss_rate_curve_warmup_and_counts():
    trace = synthetic_trace(4, 16, 2, 30, 0.5, seed=2, prefill_tokens=64)
    cold = miss_rate_curve(trace, ["lru"], [0.5])
    warm = miss_rate_curve(trace, ["lru"], [0.5], warmup_prefill=True)
    assert warm[0]["miss_rate"] < cold[0]["miss_rate"]
    full = miss_rate_curve(trace, ["lru", "static-layer"], [0.0, 1.0])
    rate = {(r["policy"], r["cache_fraction"]): r["miss_rate"] for r in full}
    assert rate[("lru", 0.0)] == 1.0 and rate[("static-layer", 1.0)] == 0.0
    distinct = len(set(trace.decode_only().flat_ids().tolist()))
    assert rate[("lru", 1.0)] == pytest.approx(distinct / trace.decode_only().num_selections)


# -- report ----------------------------------------------------------------------------


def test_cache_policies_json_and_plot(tmp_path):
    trace = synthetic_trace(4, 16, 2, 40, 0.5, seed=4)
    results = miss_rate_curve(trace, fractions=(0.1, 0.25, 0.5))
    doc = write_cache_policies_json(results, tmp_path / "cache_policies.json")
    loaded = json.loads((tmp_path / "cache_policies.json").read_text())
    assert loaded == doc and check_cache_policies_json(loaded) == []
    assert {r["policy"] for r in loaded["results"]} == set(POLICIES)
    assert check_cache_policies_json({"results": [{"policy": "lru"}]})
    plot_miss_rates(results, tmp_path / "miss_rate.png")
    assert (tmp_path / "miss_rate.png").read_bytes()[:4] == b"\x89PNG"
    table = miss_rate_table(results)
    assert table.splitlines()[0] == "| policy | 0.1 | 0.25 | 0.5 |" and f"| {OUR_POLICY} |" in table
    assert markdown_table([["a", 0.5]], ["x", "y"]) == "| x | y |\n|---|---|\n| a | 0.500 |\n"
