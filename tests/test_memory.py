"""Elastic device memory (ftjax.engine.memory): the expert cache is re-allocated
smaller as states grow (its least recently used residents go, its bytes go back to the
allocator), grows back as they shrink, never changes the tokens, and a state that cannot
fit even with an empty cache is refused up front."""

import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
import jax

from ftjax.engine.memory import DeviceMemoryError, capacity_for
from ftjax.experts.executor import FREE, resize_cache

MiB = 1 << 20


def _xstate(id_of_slot, stamps, num_experts=8):
    id_of_slot = np.asarray(id_of_slot, np.int32)
    slot_of = np.full(num_experts, -1, np.int32)
    for s, g in enumerate(id_of_slot):
        if g >= 0:
            slot_of[g] = s
    cache = {"down": jnp.arange(len(id_of_slot), dtype=jnp.float32)[:, None] * jnp.ones((1, 3))}  # row s holds s
    return {"id_of_slot": jnp.asarray(id_of_slot), "slot_of": jnp.asarray(slot_of),
            "stamp": jnp.asarray(np.asarray(stamps, np.int32)), "cache": cache}


def _table(st):
    return (np.asarray(st["id_of_slot"]).tolist(), np.asarray(st["slot_of"]).tolist(),
            np.asarray(st["cache"]["down"])[:, 0].tolist())


def test_resize_cache_keeps_the_most_recent_residents_and_their_rows():
    # slots: 0 holds expert 3 (stamp 9), 1 free, 2 holds expert 5 (stamp 2), 3 holds expert 1 (stamp 7)
    stamps = np.zeros(8, np.int32)
    stamps[[3, 5, 1]] = [9, 2, 7]
    st = _xstate([3, FREE, 5, 1], stamps)
    two = resize_cache(st, 2)  # expert 5 (oldest) goes; 3 and 1 move to slots 0, 1 with their rows
    ids, slot_of, rows = _table(two)
    assert ids == [3, 1] and slot_of[3] == 0 and slot_of[1] == 1 and slot_of[5] == -1 and rows == [0.0, 3.0]
    assert np.array_equal(two["stamp"], st["stamp"])  # recency carries over
    zero = resize_cache(two, 0)
    assert _table(zero)[0] == [] and all(v == -1 for v in _table(zero)[1]) and zero["cache"]["down"].shape == (0, 3)
    three = resize_cache(two, 3)  # growing: residents kept, new slots free
    ids, slot_of, rows = _table(three)
    assert ids == [3, 1, FREE] and rows[:2] == [0.0, 3.0]
    assert _table(resize_cache(zero, 2))[0] == [FREE, FREE]  # from nothing


def test_capacity_buckets_round_down_to_eighths():
    assert [capacity_for(n, 96) for n in (0, 11, 12, 50, 95, 96, 500)] == [0, 0, 12, 48, 84, 96, 96]
    assert capacity_for(9, 10) == 8 and capacity_for(1, 10) == 0 and capacity_for(2, 10) == 2


@pytest.fixture(scope="module")
def reference():
    return ftjax.load(policy="device", numerics="exact")  # f32 K/V: the sizes the tests name


def _elastic(budget_mib: float):
    return ftjax.load(policy="lru", cache_slots=96, bandwidth=(1.0, 1.0), device_memory_bytes=int(budget_mib * MiB),
                      numerics="exact")


@pytest.fixture(scope="module")
def probe():
    """The fixed parts of the budget (weights, prefill scratch) and the slot size, from
    a model with room for everything."""
    return _elastic(1024).memory


def test_growing_session_shrinks_the_expert_cache_with_unchanged_tokens(reference, probe):
    """Default model: 96 slots of 192 KiB, 6 KiB of K/V per token (12 MiB at 2048). A
    session growing to the full context takes the cache from all slots down to a few,
    bucket by bucket; the tokens equal the `device` reference; closing the session gives
    the slots back."""
    model = _elastic((probe.weights + probe.scratch + 96 * probe.slot_bytes) / MiB)  # all slots fit while states are empty
    mem = model.memory
    assert mem.active_slots() == 96
    ids = [int(t) for t in np.random.RandomState(0).randint(0, model.config.vocab_size, 2000)]
    s, active = model.session(), []
    for end in (100, 250, 500, 1000, 2000):  # capacity 128, 256, 512, 1024, 2048
        s.append(ids[len(s.ids):end])
        active.append(mem.active_slots())
        split = mem.split()
        assert split["free_bytes"] >= 0 and split["states_bytes"] == s.device_state_bytes()
    assert active == sorted(active, reverse=True) and active[-1] < active[0] < 96
    assert s.generate(16) == reference.generate(ids, 16)
    assert mem.active_slots() == active[-1]
    s.close()
    assert mem.active_slots() == 96 and mem.counters["grows"] >= 1
    assert model.stats()["hits"] > 0  # the slots it kept were used


def _live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


def test_yielding_gives_the_cache_bytes_back_and_keeps_the_tokens(reference, probe):
    """As a session grows, live device bytes fall by the slots the cache gives up, less
    what the state took (the buffer is re-allocated, not masked; within 64 KiB, far
    below one 192 KiB slot: logits and telemetry codes come and go); at capacity 0 every
    expert runs on the host; the tokens equal the reference; closing gives the bytes back."""
    slot = probe.slot_bytes + 4  # + the slot's id_of_slot entry (int32)
    model = _elastic((probe.weights + probe.scratch + 26 * probe.slot_bytes) / MiB)
    mem = model.memory
    assert mem.active_slots() == 24  # buckets of 96 / 8 = 12 slots, rounded down
    ids = [int(t) for t in np.random.RandomState(1).randint(0, model.config.vocab_size, 300)]
    s = model.session()
    for end, capacity in ((100, 12), (300, 0)):  # states of 128 and 512 tokens: 4 and 16 slots' bytes
        before, held, state = _live_bytes(), mem.active_slots(), s.device_state_bytes()
        s.append(ids[len(s.ids):end])
        assert mem.active_slots() == capacity == model._xstate["cache"]["down"].shape[0]
        freed = (held - capacity) * slot - (s.device_state_bytes() - state)
        assert abs((before - _live_bytes()) - freed) < 64 * 1024, (end, before - _live_bytes(), freed)
    model.reset_stats()
    assert s.generate(12) == reference.generate(ids, 12)
    stats = model.stats()
    assert stats["host_computed"] == stats["selections"] > 0  # no cache: every selection ran on the host
    model.clear_expert_cache()  # a rebuilt cache keeps the size the budget gave it
    assert model._xstate["cache"]["down"].shape[0] == mem.active_slots() == 0
    before, state = _live_bytes(), s.device_state_bytes()
    s.close()
    assert mem.active_slots() == 24 and mem.counters["grows"] == 1
    assert abs((_live_bytes() - before) - (24 * slot - state)) < 64 * 1024  # the cache came back, the state went


def test_a_state_that_cannot_fit_is_refused_before_anything_changes(probe):
    model = _elastic((probe.weights + probe.scratch) / MiB + 3)  # room for 3 MiB of states at most
    s = model.session()
    s.append(list(range(100)))  # 128 tokens: 768 KiB
    before = (s.ids, s.capacity)
    with pytest.raises(DeviceMemoryError, match="does not fit the device memory budget"):
        s.append(list(range(900)))  # 1024 tokens: 6 MiB
    assert (s.ids, s.capacity) == before and model.memory.counters["refused"] == 1
    assert len(s.generate(4)) == 4  # still usable
    with pytest.raises(DeviceMemoryError, match="weights"):
        ftjax.load(policy="lru", cache_slots=8, bandwidth=(1.0, 1.0), device_memory_bytes=MiB)
    with pytest.raises(ValueError, match="accelerator"):
        ftjax.load(device_memory_bytes="auto")


def test_server_refuses_what_cannot_fit_and_shows_the_split(probe):
    """`--device-memory-gb` through the real server: a request whose state alone cannot
    fit is a 400 naming the budget; /v1/stats shows the split; requests that fit run."""
    openai = pytest.importorskip("openai")
    import serving

    budget_gb = (probe.weights + probe.scratch + 40 * probe.slot_bytes + 4 * MiB) / 2**30
    with serving.server("--policy", "lru", "--cache-slots", "96", "--bandwidth", "1", "1",
                        "--device-memory-gb", f"{budget_gb:.6f}", "--state-cache", "off", "--numerics", "exact") as port:
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        r = oai.chat.completions.create(model="ftjax-default", messages=[{"role": "user", "content": "Hello"}],
                                        max_tokens=8, temperature=0)
        assert r.usage.completion_tokens == 8
        with pytest.raises(openai.BadRequestError, match="device memory budget"):
            oai.chat.completions.create(model="ftjax-default", messages=[{"role": "user", "content": "Hello"}],
                                        max_tokens=2000)
        split = serving.get_json(port, "/v1/stats")["memory_split"]
        assert split["expert_slots_max"] == 96 and 0 < split["expert_slots_active"] <= 96
        assert abs(split["budget_bytes"] - budget_gb * 2**30) < 2**10 and split["states_bytes"] == 0
