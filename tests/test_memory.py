"""Elastic device memory (ftjax.engine.memory): the expert cache yields its least
recently used slots as states grow, grows back as they shrink, never changes the
tokens, and a state that cannot fit even with an empty cache is refused up front."""

import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
from ftjax.engine.memory import DeviceMemoryError
from ftjax.experts.executor import DISABLED, FREE, active_slots, set_active_slots

MiB = 1 << 20


def _xstate(id_of_slot, stamps, num_experts=8):
    id_of_slot = np.asarray(id_of_slot, np.int32)
    slot_of = np.full(num_experts, -1, np.int32)
    for s, g in enumerate(id_of_slot):
        if g >= 0:
            slot_of[g] = s
    return {"id_of_slot": jnp.asarray(id_of_slot), "slot_of": jnp.asarray(slot_of),
            "stamp": jnp.asarray(np.asarray(stamps, np.int32))}


def test_set_active_slots_disables_free_then_oldest_and_grows_back():
    # slots: 0 holds expert 3 (stamp 9), 1 free, 2 holds expert 5 (stamp 2), 3 holds expert 1 (stamp 7)
    stamps = np.zeros(8, np.int32)
    stamps[[3, 5, 1]] = [9, 2, 7]
    st = _xstate([3, FREE, 5, 1], stamps)
    two = set_active_slots(st, jnp.int32(2))  # the free slot, then expert 5 (oldest)
    assert np.asarray(two["id_of_slot"]).tolist() == [3, DISABLED, DISABLED, 1]
    assert np.asarray(two["slot_of"])[5] == -1 and np.asarray(two["slot_of"])[3] == 0
    assert active_slots(two) == 2
    zero = set_active_slots(two, jnp.int32(0))
    assert np.asarray(zero["id_of_slot"]).tolist() == [DISABLED] * 4 and (np.asarray(zero["slot_of"]) == -1).all()
    three = set_active_slots(zero, jnp.int32(3))  # re-enabled as free slots, lowest index first
    assert np.asarray(three["id_of_slot"]).tolist() == [FREE, FREE, FREE, DISABLED]


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
