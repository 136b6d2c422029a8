"""The heterogeneous expert executor: every policy computes the same function as
`device`, its counters add up, and its per-record decisions equal an offline replay of
the LRU rules (`ftjax.lab.lru.simulate_lru`) on the same selections."""

import numpy as np
import pytest

import ftjax
import hf_models
from ftjax.experts.policy import adaptive_q, transfer_ratio
from ftjax.lab.lru import first_mismatch, simulate_lru
from ftjax.lab.trace import Trace

PROMPT = [int(t) for t in np.random.RandomState(1).randint(0, 96, size=12)]
NEW = 12


_SETUPS = {}


def family_setup(family, tmp_path_factory):
    """A tiny random model of `family` and its `device`-policy reference run (cached)."""
    if family not in _SETUPS:
        hf = hf_models.build(family, seed=11, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[])
        path = hf_models.save(hf, tmp_path_factory.mktemp(family))
        ref = ftjax.load(path)
        steps = []
        tokens = list(ref.generate_stream(PROMPT, NEW, step_logits=steps))
        _SETUPS[family] = (path, tokens, np.stack(steps), ref.config)
    return _SETUPS[family]


@pytest.fixture
def setup(request, tmp_path_factory):
    return family_setup(getattr(request, "param", "qwen3_moe"), tmp_path_factory)


def run(path, **kw):
    model = ftjax.load(path, threads=2, prefill="cached", **kw)  # the LRU rules govern the cached path
    steps = []
    tokens = list(model.generate_stream(PROMPT, NEW, step_logits=steps))
    return model, tokens, np.stack(steps)


def assert_same_function(setup, model, tokens, logits):
    _, ref_tokens, ref_logits, _ = setup
    assert tokens == ref_tokens
    np.testing.assert_allclose(logits, ref_logits, atol=2e-5 * np.abs(ref_logits).max(), rtol=0)


def assert_counters(model):
    s = model.stats()
    assert s["selections"] > 0
    assert s["hits"] + s["misses"] == s["selections"]
    assert s["misses"] == s["fetched"] + s["host_computed"]
    log = model.expert_log()
    assert sum(len(r["selected"]) for r in log) == s["selections"]
    assert {r["phase"] for r in log} == {"prefill", "decode"}
    return log


def replay(model, log, slots, policy, bandwidth):
    cfg = model.config
    trace = Trace.from_records(log, cfg.num_moe_layers, cfg.num_experts)
    return simulate_lru(trace, slots, policy, bandwidth)


@pytest.mark.parametrize("setup,policy", [
    ("qwen3_moe", "host"), ("qwen3_moe", "static-layer"), ("qwen3_moe", "static-frequency"),
    ("qwen3_moe", "lru-host-only"), ("qwen3_moe", "lru-transfer-only"),
    ("qwen2_moe", "host"), ("qwen2_moe", "lru-transfer-only"),  # shared expert beside routed ones
], indirect=["setup"])
def test_policies_compute_the_device_function(setup, policy):
    path, *_, cfg = setup
    total = cfg.num_moe_layers * cfg.num_experts
    kw = {} if policy == "host" else {"cache_slots": total // 2}
    if policy == "static-frequency":
        kw["frequency"] = np.random.RandomState(0).randint(0, 50, size=(cfg.num_moe_layers, cfg.num_experts))
    model, tokens, logits = run(path, policy=policy, **kw)
    assert_same_function(setup, model, tokens, logits)
    log = assert_counters(model)
    s = model.stats()
    if policy in ("host", "lru-host-only", "static-layer", "static-frequency"):
        assert s["fetched"] == 0
    if policy == "host":
        assert s["hits"] == 0
    if policy == "static-layer":  # exactly the first slots // E layers are resident
        resident_layers = (total // 2) // cfg.num_experts
        assert all((r["layer"] < resident_layers) == (not r["host"]) for r in log if r["selected"])
    if policy.startswith("lru"):
        assert first_mismatch(replay(model, log, total // 2, policy, None), log) is None


@pytest.mark.parametrize("setup,slots_frac,bandwidth", [
    ("qwen3_moe", 0.0, (1.0, 4.0)),  # one slot
    ("qwen3_moe", 0.3, (1.0, 4.0)),  # RTX 4060 laptop-like: q* ~ m/4
    ("qwen3_moe", 0.3, (49.0, 53.8)),  # RTX 5090 desktop-like: q* ~ m
    ("qwen3_moe", 0.3, (5.0, 1.0)),  # link faster than the host: q = m
    ("qwen3_moe", 1.0, (1.0, 2.0)),  # room for every expert
    ("qwen2_moe", 0.3, (1.0, 2.0)),
], indirect=["setup"])
def test_lru_matches_offline_replay(setup, slots_frac, bandwidth):
    path, *_, cfg = setup
    total = cfg.num_moe_layers * cfg.num_experts
    slots = max(1, int(slots_frac * total))
    model, tokens, logits = run(path, policy="lru", cache_slots=slots, bandwidth=bandwidth)
    assert_same_function(setup, model, tokens, logits)
    log = assert_counters(model)
    lab = replay(model, log, slots, "lru", bandwidth)
    assert first_mismatch(lab, log) is None
    s = model.stats()
    assert {k: s[k] for k in lab.totals()} == lab.totals()
    # the device slot table ends exactly where the replay's does
    np.testing.assert_array_equal(np.asarray(model._xstate["id_of_slot"]), lab.final_slot_table)
    # q follows the rule: fetched = min(q*(m), slots - hits) in every record
    r = transfer_ratio(*bandwidth)
    for rec in log:
        m = len(rec["fetched"]) + len(rec["host"])
        assert len(rec["fetched"]) == min(adaptive_q(m, r), slots - len(rec["hits"]))


def test_cache_persists_and_clears(setup):
    path, *_, cfg = setup
    model, *_ = run(path, policy="lru-transfer-only", cache_slots=cfg.num_moe_layers * cfg.num_experts)
    model.reset_stats()
    model.generate(PROMPT, 4)
    warm = model.stats()
    assert warm["misses"] == 0  # everything fetched by the first run is still resident
    model.clear_expert_cache()
    model.reset_stats()
    model.generate(PROMPT, 4)
    cold = model.stats()
    assert cold["misses"] > 0 and cold["fetched"] == cold["misses"]


def test_cache_bytes_and_bad_settings(setup):
    path, *_ = setup
    probe = ftjax.load(path)
    eb = probe.checkpoint.pool.expert_bytes
    model = ftjax.load(path, policy="lru-transfer-only", cache_bytes=3.5 * eb)
    assert model.stats()["cache_slots"] == 3
    with pytest.raises(ValueError, match="cache_slots"):
        ftjax.load(path, policy="lru")
    with pytest.raises(ValueError, match="unknown policy"):
        ftjax.load(path, policy="fifo")
    with pytest.raises(ValueError, match="cache_slots must be in"):
        ftjax.load(path, policy="lru-transfer-only", cache_slots=10_000)


def test_pool_view_aliases_host_memory(setup):
    """On the CPU backend the device view of the expert pool is the host pool itself
    (no second copy of the largest object in the process)."""
    path, *_ = setup
    model = ftjax.load(path, policy="lru-host-only", cache_slots=3)
    pool = model.checkpoint.pool
    assert model._pool_dev["gate_up"].unsafe_buffer_pointer() == pool.gate_up.ctypes.data
    assert model._pool_dev["down"].unsafe_buffer_pointer() == pool.down.ctypes.data


# ---- the decode bookkeeping (over the assignments) against the prefill one (sorts) ----

def random_book(rng, Lm, E, slots, t):
    """A consistent slot table: some experts resident in random slots, stamps < t with
    many ties (records select several experts), some slots free."""
    n_res = rng.integers(0, slots + 1)
    residents = rng.choice(Lm * E, n_res, replace=False)
    where = rng.choice(slots, n_res, replace=False)
    slot_of = np.full(Lm * E, -1, np.int32)
    id_of_slot = np.full(slots, -1, np.int32)
    slot_of[residents], id_of_slot[where] = where, residents
    stamp = rng.integers(0, t, Lm * E).astype(np.int32)  # < t, with ties; 0 = never used
    return slot_of, id_of_slot, stamp


@pytest.mark.parametrize("N,K,E,Lm,slots,table", [
    (1, 2, 16, 4, 8, "transfer"),  # decode: nothing fetched, free slots, full cache evictions
    (1, 2, 16, 4, 2, "transfer"),  # fewer slots than misses
    (1, 8, 8, 3, 5, "adaptive"),  # every expert selected, q* split
    (1, 1, 4, 2, 1, "transfer"),  # one slot
    (4, 2, 6, 2, 4, "transfer"),  # several tokens: repeated experts, invalid tokens
    (2, 3, 8, 2, 6, "host"),  # q = 0: no bookkeeping of slots at all
])
def test_few_assignment_bookkeeping_matches_sorted(N, K, E, Lm, slots, table):
    """`lru_few` (decode: comparisons over the assignments) decides exactly what
    `lru_many` (sorts over every expert and slot) decides, on random states."""
    import jax
    import jax.numpy as jnp
    from ftjax.experts.executor import lru_few, lru_many, selected_mask
    from ftjax.experts.policy import POLICIES, q_table

    policy = {"transfer": "lru-transfer-only", "adaptive": "lru", "host": "lru-host-only"}[table]
    q_of = jnp.asarray(q_table(POLICIES[policy], E, 0.4))
    A = N * K
    P = int(min(slots, np.asarray(q_of)[: min(A, E) + 1].max()))
    few = jax.jit(lambda a, sel, base, book, t: lru_few(a, sel, base, E, slots, q_of, P, *book, t), static_argnums=2)
    many = jax.jit(lambda sel, base, book, t: lru_many(sel, base, E, slots, q_of, *book, t), static_argnums=1)
    rng = np.random.default_rng(N * 1000 + K * 100 + slots)
    for case in range(60):
        layer, t = int(rng.integers(Lm)), int(rng.integers(1, 40))
        book = random_book(rng, Lm, E, slots, t)
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32)
        valid = rng.random(N) < (0.8 if N > 1 else 1.0)
        ids = np.where(valid[:, None], ids, -1)
        sel = selected_mask(jnp.asarray(ids), E)
        book_f, codes_f, (expert, slot, do) = few(jnp.asarray(ids.reshape(-1)), sel, layer * E, book, jnp.int32(t))
        book_m, codes_m, fetched, target = many(sel, layer * E, book, jnp.int32(t))
        for name, f, m in zip(("slot_of", "id_of_slot", "stamp"), book_f, book_m):
            np.testing.assert_array_equal(np.asarray(f), np.asarray(m), err_msg=f"case {case}: {name}")
        np.testing.assert_array_equal(np.asarray(codes_f), np.asarray(codes_m), err_msg=f"case {case}: codes")
        do = np.asarray(do)
        copies = sorted(zip(np.asarray(expert)[do].tolist(), np.asarray(slot)[do].tolist()))
        fetched = np.asarray(fetched)
        assert copies == sorted(zip(np.flatnonzero(fetched).tolist(), np.asarray(target)[fetched].tolist())), case


@pytest.mark.parametrize("N", [2, 40])  # the comparison form and the scatter form
def test_selected_mask_ignores_assignments_without_an_expert(N):
    import jax.numpy as jnp

    from ftjax.experts.executor import selected_mask

    ids = np.full((N, 2), -1, np.int32)
    ids[0] = [3, -1]  # a token with one expert another device owns
    ids[1] = [5, 3]
    assert np.flatnonzero(np.asarray(selected_mask(jnp.asarray(ids), 8))).tolist() == [3, 5]


@pytest.mark.parametrize("N,K,E,first", [(3, 2, 8, 0), (20, 2, 8, 8), (300, 8, 64, 64), (130, 2, 4, 4)])
def test_device_ffn_sums_each_tokens_own_experts(N, K, E, first):
    """`executor.device_ffn` in each of its forms (decode unrolled: N*K <= 16; batched: <= 64;
    prompts: assignments grouped by expert into tiles of 64, groups of 150+ assignments
    spanning several tiles) against numpy: y[n] = sum_k w[n,k] expert_{rows[n,k]}(x[n]),
    rows < 0 skipped, rows read from a pool slice that starts at `first`."""
    import jax
    import jax.numpy as jnp

    from ftjax.experts.executor import device_ffn
    from ftjax.host import reference_expert_ffn

    rng = np.random.default_rng(N)
    D, F, L = 16, 8, 3
    gate_up = (0.3 * rng.standard_normal((L * E, 2 * F, D))).astype(np.float32)
    down = (0.3 * rng.standard_normal((L * E, D, F))).astype(np.float32)
    x = rng.standard_normal((N, D)).astype(np.float32)
    rows = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32) + first
    rows[::5, 0] = -1  # assignments without an expert
    w = rng.random((N, K)).astype(np.float32)
    y = jax.jit(lambda *a: device_ffn(*a, row_range=(first, E)))(gate_up, down, x, jnp.asarray(rows), w)
    ids = np.where(rows >= 0, rows - first, -1)  # first = layer * E: the pool's layer `first // E`
    ref = reference_expert_ffn(gate_up.reshape(L, E, 2 * F, D), down.reshape(L, E, D, F), first // E, x, ids, w)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=2e-5 * np.abs(ref).max())
