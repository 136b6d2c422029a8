"""Sessions: appending in pieces equals appending at once, forks are independent,
snapshots resume exactly (also through a file), several prompts decoded together give
each prompt's own tokens, and interleaved sessions do not disturb each other — for every
family, under the `device`, `host` and `lru` policies."""

import numpy as np
import pytest

import ftjax
import hf_models
from ftjax.engine.session import Snapshot, generate_batch

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
POLICIES = {"device": {}, "host": {}, "lru": dict(cache_slots=6, bandwidth=(1.0, 2.0))}
RNG = np.random.RandomState(5)
PROMPTS = [[int(t) for t in RNG.randint(0, 96, size=n)] for n in (3, 9, 17, 30)]
NEW = 8

_PATHS = {}


def model_path(family, tmp_path_factory):
    if family not in _PATHS:
        hf = hf_models.build(family, seed=31, num_experts=8, num_experts_per_tok=2)
        _PATHS[family] = hf_models.save(hf, tmp_path_factory.mktemp(family))
    return _PATHS[family]


def load(family, policy, tmp_path_factory, **kw):
    return ftjax.load(model_path(family, tmp_path_factory), policy=policy, threads=2, **kw, **POLICIES[policy])


def tol(ref):
    return 2e-5 * np.abs(ref).max()


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("family", FAMILIES)
def test_session_api(family, policy, tmp_path_factory):
    model = load(family, policy, tmp_path_factory)
    prompt = PROMPTS[3]
    ref_logits = model.logits(prompt)  # [T, V], one forward from an empty session
    ref_tokens = model.generate(prompt, NEW)

    # piecewise append == whole append: logits of every piece, then the same greedy tokens
    s = model.session()
    assert s.position == 0 and s.ids == []
    pieces = [prompt[:1], prompt[1:12], prompt[12:]]
    for i, piece in enumerate(pieces):
        last = s.append(piece)
        end = sum(map(len, pieces[:i + 1]))
        np.testing.assert_allclose(last, ref_logits[end - 1], atol=tol(ref_logits), rtol=0)
    assert s.position == len(prompt) and s.ids == prompt
    seg = model.session()
    seg.append(prompt[:10])
    np.testing.assert_allclose(seg.logits(prompt[10:]), ref_logits[10:], atol=tol(ref_logits), rtol=0)

    # fork: both continue from the same point and diverge freely
    t = s.fork()
    assert s.generate(NEW) == ref_tokens and s.position == len(prompt) + NEW
    t.append([7, 8])  # t diverges ...
    assert t.ids == prompt + [7, 8] and s.ids == prompt + ref_tokens  # ... and s is untouched
    u = model.session()
    u.append(prompt + [7, 8])
    assert t.generate(4) == u.generate(4)

    # generate continues where the last generate stopped (its last token is pending)
    whole = model.generate(prompt, 2 * NEW)
    s2 = model.session()
    s2.append(prompt)
    assert s2.generate(NEW) + s2.generate(NEW) == whole

    # snapshot round trip, in memory and through a file
    snap = s.snapshot()
    assert snap.position == s.position and snap.ids == s.ids
    cont = s.generate(NEW, temperature=0.9, top_p=0.9, seed=3)
    for restored in (model.session(snap), model.session(Snapshot.load(snap.save(tmp_path_factory.mktemp("snap") / "s")))):
        assert restored.position == snap.position and restored.ids == snap.ids
        assert restored.generate(NEW, temperature=0.9, top_p=0.9, seed=3) == cont


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_many_equals_each_generate(family, policy, tmp_path_factory):
    model = load(family, policy, tmp_path_factory)
    own = [model.generate(p, NEW) for p in PROMPTS]
    assert model.generate_many(PROMPTS, NEW) == own
    sampled = dict(temperature=0.8, top_k=20, seed=4)
    assert model.generate_many(PROMPTS[:3], NEW, **sampled) == [model.generate(p, NEW, **sampled) for p in PROMPTS[:3]]
    s = model.stats()
    assert s["hits"] + s["misses"] == s["selections"] and s["misses"] == s["fetched"] + s["host_computed"]


def test_interleaved_sessions_do_not_disturb_each_other(tmp_path_factory):
    model = load("qwen3_moe", "lru", tmp_path_factory)
    refs = [model.generate(p, NEW) for p in PROMPTS[:3]]
    sessions = [model.session() for _ in range(3)]
    for s, p in zip(sessions, PROMPTS):
        s.append(p)
    streams = [s.generate_stream(NEW) for s in sessions]
    got = [[] for _ in sessions]
    for _ in range(NEW):  # one token of each in turn
        for out, stream in zip(got, streams):
            out.append(next(stream))
    assert got == refs


def test_batched_decode_past_the_unrolled_size(tmp_path_factory):
    """8 sessions at top-2 (16 assignments) and top-4 (32): the distinct-experts device
    FFN and the comparison bookkeeping; 8 at top-8 (64) and 16 at top-8 (128, the sort
    form) still give every prompt its own tokens."""
    rng = np.random.RandomState(9)
    prompts = [[int(t) for t in rng.randint(0, 96, size=n)] for n in range(2, 18)]
    for k, batch in ((4, 8), (8, 16)):
        hf = hf_models.build("qwen3_moe", seed=41, num_experts=12, num_experts_per_tok=k)
        path = hf_models.save(hf, tmp_path_factory.mktemp(f"top{k}"))
        for policy, kw in (("device", {}), ("lru", dict(cache_slots=10, bandwidth=(1.0, 1.0)))):
            model = ftjax.load(path, policy=policy, threads=2, **kw)
            own = [model.generate(p, 5) for p in prompts[:batch]]
            assert model.generate_many(prompts[:batch], 5) == own, (k, batch, policy)


def test_session_errors(tmp_path_factory):
    model = load("qwen3_moe", "device", tmp_path_factory, max_seq_len=40)
    s = model.session()
    with pytest.raises(ValueError, match="empty"):
        s.generate(3)
    with pytest.raises(ValueError, match="empty"):
        s.snapshot()
    s.append(PROMPTS[3])
    with pytest.raises(ValueError, match="do not fit the context of 40"):
        s.append(list(range(11)))
    assert s.position == 30  # a rejected append changes nothing
    assert len(s.generate(20)) == 10 and s.last_generation.stop_reason == "context"
    with pytest.raises(ValueError, match="bad sampling setting: temperature"):
        s.generate(2, temperature=float("nan"))
    other = load("mixtral", "device", tmp_path_factory)
    with pytest.raises(ValueError, match="another model"):
        other.session(s.snapshot())
    with pytest.raises(ValueError, match="distinct sessions"):
        generate_batch([s, s], 2)


def test_telemetry_is_bounded(tmp_path_factory):
    model = load("qwen3_moe", "host", tmp_path_factory, keep_records=3)
    model.generate(PROMPTS[2], 10)
    log, s = model.expert_log(), model.stats()
    # 1 prefill + 9 decode steps (the first token is sampled from the prefill's logits)
    assert sorted({r["step"] for r in log}) == [8, 9, 10]  # the last three steps only
    assert s["steps"] == 10 and s["log_steps_dropped"] == 7
    assert s["selections"] == s["hits"] + s["misses"]
    assert s["selections"] > sum(len(r["selected"]) for r in log)  # counters stay cumulative
    off = load("qwen3_moe", "host", tmp_path_factory, keep_records=0)
    off.generate(PROMPTS[2], 4)
    assert off.expert_log() == [] and off.stats()["selections"] > 0
    with pytest.raises(ValueError, match="keep_records"):
        load("qwen3_moe", "host", tmp_path_factory, keep_records=-1)


def test_decode_speed_leaves_out_the_compiling_first_step():
    from ftjax.engine.session import GenerationStats

    g = GenerationStats(prompt_tokens=3, new_tokens=10, ttft_s=0.1, decode_s=1.0, first_step_s=0.5)
    assert g.decode_tok_per_s == pytest.approx(8 / 0.5)  # 9 decode steps, the first (compile) apart
    assert GenerationStats(new_tokens=2, decode_s=0.5, first_step_s=0.5).decode_tok_per_s == pytest.approx(2.0)
    assert GenerationStats(new_tokens=1).decode_tok_per_s == 0.0
    # a later step at a larger state (it compiled) is left out too
    g = GenerationStats(new_tokens=10, decode_s=1.0, first_step_s=0.5, reshape_steps=1, reshape_s=0.3)
    assert g.decode_tok_per_s == pytest.approx(7 / 0.2)


def test_a_generation_that_outgrows_its_capacity_counts_that_step_apart():
    """7 prompt tokens + 130 new cross the first capacity bucket: the step at the larger
    state (a new program: compiled or read back) is counted in reshape_steps / reshape_s,
    out of the steady rate, and nowhere else."""
    from ftjax.engine.shapes import MIN_CAPACITY

    m = ftjax.load()
    session = m.session()
    session.generate(MIN_CAPACITY + 2, prompt=list(range(1, 8)))
    g = session.last_generation
    assert g.new_tokens == MIN_CAPACITY + 2 and g.stop_reason == "length"
    assert g.reshape_steps == 1 and 0 < g.reshape_s < g.decode_s - g.first_step_s
    steady = (g.new_tokens - 3) / (g.decode_s - g.first_step_s - g.reshape_s)
    assert g.decode_tok_per_s == pytest.approx(steady)
    session.generate(4)  # the same capacity: no new shape
    assert session.last_generation.reshape_steps == 0


def test_a_stream_shows_its_first_token_before_the_first_decode_step():
    """`generate_stream` yields the first token (sampled from the prompt's logits) before
    the scheduler runs a decode step, which in a new process compiles or reads back its
    program: at the first yield one token exists. The tokens are generate's."""
    m = ftjax.load()
    prompt = m.tokenizer.encode("It is a truth universally acknowledged")
    session = m.session()
    stream = session.generate_stream(6, prompt=prompt)
    first = next(stream)
    assert session.last_generation.new_tokens == 1
    assert [first, *stream] == m.generate(prompt, 6)
