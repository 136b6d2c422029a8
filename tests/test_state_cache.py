"""The semantic state cache (ftjax.engine.state_cache): reuse at block boundaries for
attention and Gated DeltaNet layers (a resumed request gives exactly the tokens of a cold
prefill), the reasoning-stripping rewrite, host and disk tiers, persistence, and the
token counts the server reports."""

import jax
import numpy as np
import pytest

import ftjax
import hf_models
from ftjax.engine.state_cache import StateCache, boundary_ends, boundary_patterns

THINK, CALL, OUTPUT = 4091, 4093, 4095  # the default model's </think>, </tool_call>, </tool_output>


@pytest.fixture(scope="module")
def default_model():
    return ftjax.load(policy="host")


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    """Qwen3-Next: Gated DeltaNet layers (fixed-size recurrent state) + gated attention."""
    path = hf_models.save(hf_models.build("qwen3_next", seed=3), tmp_path_factory.mktemp("hybrid"))
    return ftjax.load(path, policy="host")


def _tags(model) -> tuple[int, int, int]:
    """The closing tags' ids: the tokenizer's, or (tokenizer-less test model) the last three ids."""
    V = model.config.vocab_size
    return (THINK, CALL, OUTPUT) if model.tokenizer is not None else (V - 3, V - 2, V - 1)


def _prompt(model, seed: int = 0, n: int = 48) -> list[int]:
    """Random ids (no tag among them) with </think> at 9, </tool_call> at 19, </tool_output> at 29."""
    tags = _tags(model)
    ids = [int(t) for t in np.random.RandomState(seed).randint(0, min(tags), n)]
    ids[9], ids[19], ids[29] = tags
    return ids


def _cache(model, **kw):
    return StateCache(model, "semantic", patterns=[(t,) for t in _tags(model)], **kw)


def test_boundary_ends_single_and_multi_token():
    ids = [5, 1, 2, 3, 9, 1, 2, 3, 7, 4]
    assert boundary_ends(ids, [(1, 2, 3)]) == [4, 8]
    assert boundary_ends(ids, [(7,), (1, 2, 3)]) == [4, 8, 9]
    assert boundary_ends(ids, [(3, 9, 9)]) == []


def test_tags_come_from_the_tokenizer(default_model, hybrid_model):
    """The closing tags' ids come from the tokenizer; an attention-only model is cut at
    any token (no boundary snapshots needed), a recurrent one snapshots at the tags."""
    assert {(THINK,), (CALL,), (OUTPUT,)} <= set(boundary_patterns(default_model.tokenizer))
    ids = default_model.tokenizer.encode("a</think>b</tool_call>c\n</tool_output>\nd")
    assert boundary_ends(ids, boundary_patterns(default_model.tokenizer)) == \
        [ids.index(THINK) + 1, ids.index(CALL) + 1, ids.index(OUTPUT) + 1]
    cut = StateCache(default_model, "semantic")
    assert cut.cuttable and cut.boundaries(ids) == [len(ids)]
    hybrid = _cache(hybrid_model)
    assert not hybrid.cuttable and hybrid.boundaries(_prompt(hybrid_model)) == [10, 20, 30, 48]
    assert StateCache(hybrid_model, "prefix").boundaries(_prompt(hybrid_model)) == [48]


@pytest.mark.parametrize("family", ["default_model", "hybrid_model"])
@pytest.mark.parametrize("boundary", [10, 20, 30])
def test_reuse_after_each_boundary_equals_cold_prefill(request, family, boundary):
    """A prompt that shares the first request up to a block's end reuses exactly that
    prefix (K/V by prefix; the DeltaNet state from the snapshot) and then generates the
    tokens a cold prefill generates."""
    model = request.getfixturevalue(family)
    cache = _cache(model)
    first = _prompt(model)
    cache.prefill(first)
    second = first[:boundary] + [7, 8, 9, 10, 11]
    session, reused = cache.prefill(second)
    assert reused == boundary
    assert session.generate(8) == model.generate(second, 8)
    assert cache.counters["hits"] == 1 and cache.counters["tokens_reused"] == boundary


def test_exact_prompt_is_resumed_from_its_logits(hybrid_model):
    cache = _cache(hybrid_model)
    ids = _prompt(hybrid_model, seed=1)
    cache.prefill(ids)
    session, reused = cache.prefill(ids)
    assert reused == len(ids)
    assert session.generate(6) == hybrid_model.generate(ids, 6)


def _common(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_reasoning_stripping_rewrite_reuses_up_to_the_first_change(default_model):
    """Attention-only model, real chat template: turn 2 holds turn 1's reasoning, the
    agent's turn 3 drops it, another request trims the tool output. Each reuses exactly
    up to its first changed token (in both modes: K/V can be cut anywhere) and then
    generates what a cold prefill generates."""
    tok = default_model.tokenizer
    system = {"role": "system", "content": "You are a careful agent. " * 20}
    user = {"role": "user", "content": "Read the file notes.txt and summarise it."}
    call = {"role": "assistant", "reasoning_content": "I should read the file first.", "content": "",
            "tool_calls": [{"function": {"name": "read_file", "arguments": {"path": "notes.txt"}}}]}
    output = {"role": "tool", "content": "line one\nline two\nline three\n" * 8}
    render = lambda msgs: tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))  # noqa: E731
    turn1 = render([system, user])
    turn2 = render([system, user, call, output])
    stripped = {k: v for k, v in call.items() if k != "reasoning_content"}
    turn3 = render([system, user, stripped, output])
    trimmed = render([system, user, call, {"role": "tool", "content": "line one\n[... trimmed]"}])
    assert _common(turn3, turn2) == len(turn1) and _common(trimmed, turn2) > turn2.index(CALL) + 1
    for mode in ("prefix", "semantic"):
        cache = StateCache(default_model, mode)
        for ids in (turn1, turn2):
            cache.prefill(ids)
        session, reused = cache.prefill(turn3)
        assert reused == len(turn1)
        assert session.generate(6) == default_model.generate(turn3, 6)
        session, reused = cache.prefill(trimmed)
        assert reused == _common(trimmed, turn2)
        assert session.generate(6) == default_model.generate(trimmed, 6)


def test_rewrite_on_a_recurrent_model_reuses_up_to_the_preceding_boundary(hybrid_model):
    """Gated DeltaNet: a state exists only where it was saved. Turn 2 = turn 1 + a
    tool call + its output; turn 3 trims that output: semantic mode resumes after
    </tool_call>, prefix mode only after turn 1."""
    think, call, output = _tags(hybrid_model)
    rng = np.random.RandomState(7)
    words = lambda n: [int(t) for t in rng.randint(0, think, n)]  # noqa: E731
    turn1 = words(30)
    turn2 = turn1 + words(5) + [call] + words(12) + [output] + words(4)
    turn3 = turn2[:turn2.index(call) + 4] + words(3) + [output] + words(4)  # the output trimmed
    for mode, want in (("prefix", len(turn1)), ("semantic", turn2.index(call) + 1)):
        cache = StateCache(hybrid_model, mode, patterns=[(t,) for t in (think, call, output)])
        cache.prefill(turn1)
        cache.prefill(turn2)
        session, reused = cache.prefill(turn3)
        assert reused == want
        assert session.generate(6) == hybrid_model.generate(turn3, 6)


@pytest.mark.parametrize("family", ["default_model", "hybrid_model"])
def test_host_tier_eviction_and_restore(request, family):
    model = request.getfixturevalue(family)
    cache = _cache(model, device_bytes=0)  # every snapshot moves to the host at once
    first = _prompt(model, seed=2)
    nodes = len(cache.boundaries(first))  # 1 (attention: the prompt's end) or 4 (recurrent: + 3 tags)
    cache.prefill(first)
    st = cache.stats()
    assert st["entries"]["device"] == 0 and st["entries"]["host"] == nodes and st["to_host"] == nodes
    second = first[:20] + [3, 4, 5]
    session, reused = cache.prefill(second)
    assert reused == 20 and cache.counters["from_host"] == (1 if cache.cuttable else 2)  # the nodes on the path
    assert session.generate(6) == model.generate(second, 6)


def test_budgets_drop_least_recently_used_leaves(hybrid_model):
    cache = _cache(hybrid_model, device_bytes=0, host_bytes=0)  # no disk tier: evicted = dropped
    cache.prefill(_prompt(hybrid_model, seed=3))
    st = cache.stats()
    assert st["dropped"] == 4 and sum(st["entries"].values()) == 0
    with pytest.raises(ValueError, match="device_bytes"):
        StateCache(hybrid_model, "semantic", device_bytes=-1)
    with pytest.raises(ValueError, match="mode"):
        StateCache(hybrid_model, "everything")


def test_radix_split_stores_a_shared_prefix_once(default_model):
    """Two prompts that part at token 40: the first's node is split there, the shared
    K/V is held once, and both (and the split point itself) restore exactly."""
    cache = StateCache(default_model, "semantic")
    a = _prompt(default_model, seed=5, n=60)
    b = a[:40] + [1, 2, 3]
    cache.prefill(a)
    cache.prefill(b)
    assert sorted(n.depth for n in cache._nodes()) == [40, 43, 60]
    kv = sum(x.nbytes for x in jax.tree.leaves(default_model.new_state(1, 1)))  # one token's K/V
    # rows per node, each padded to a power of two: 40 shared (64), the first prompt's other 20 (32), the
    # second's 3 (16); logits at the two prompt ends. The 40 shared tokens are held once.
    assert cache.stats()["bytes"]["device"] == (64 + 32 + 16) * kv + 2 * 4 * default_model.config.vocab_size
    for ids, want in ((a, 60), (b, 43), (a[:40], 39)):  # the split point has no logits: its last token again
        session, reused = cache.prefill(ids)
        assert reused == want
        assert session.generate(4) == default_model.generate(ids, 4)


@pytest.mark.parametrize("family", ["default_model", "hybrid_model"])
def test_disk_tier_persists_across_restarts(request, family, tmp_path):
    model = request.getfixturevalue(family)
    first = _prompt(model, seed=4)
    cache = _cache(model, disk_dir=tmp_path / "states")
    nodes = len(cache.boundaries(first))
    cache.prefill(first)
    cache.close()
    assert cache.stats()["entries"]["disk"] == nodes
    again = _cache(model, disk_dir=tmp_path / "states")  # a restarted process
    assert again.stats()["entries"]["disk"] == nodes
    second = first[:30] + [1, 2, 3]
    session, reused = again.prefill(second)
    assert reused == 30 and again.counters["from_disk"] == (1 if again.cuttable else 3)
    assert session.generate(6) == model.generate(second, 6)
    # another model's snapshots in the folder are not picked up
    other = ftjax.load(policy="host", kv_dtype="bfloat16") if family == "default_model" else None
    if other is not None:
        assert _cache(other, disk_dir=tmp_path / "states").stats()["entries"]["disk"] == 0


def test_server_reports_cached_tokens_and_resumes_after_restart(default_model, tmp_path):
    """Through the real server and SDKs: turn 2 reuses turn 1's prompt and says so
    (`prompt_tokens_details.cached_tokens`, `cache_read_input_tokens`); after a restart
    on the same --state-cache-dir the whole turn-2 prompt is restored from disk, and the
    output equals a cold `Model.generate`."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    import serving

    tok = default_model.tokenizer
    turn1 = [{"role": "system", "content": "You answer questions about novels. " * 10},
             {"role": "user", "content": "Who is Mr. Knightley?"}]
    turn2 = turn1 + [{"role": "assistant", "content": "A friend of Emma."},
                     {"role": "user", "content": "And Harriet Smith?"}]
    ids1, ids2 = tok.encode_chat(turn1), tok.encode_chat(turn2)
    assert ids2[:len(ids1)] == ids1
    want = tok.decode(default_model.generate(ids2, 10)).strip()
    # the server runs the reference's model: the same policy (under numerics="fast" host
    # experts prefill on the bf16 tiles, device ones in XLA's f32: other roundings)
    args = ("--policy", "host", "--state-cache", "semantic", "--state-cache-dir", str(tmp_path / "states"))
    with serving.server(*args) as port:
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        r1 = oai.chat.completions.create(model="ftjax-default", messages=turn1, max_tokens=4, temperature=0)
        r2 = oai.chat.completions.create(model="ftjax-default", messages=turn2, max_tokens=10, temperature=0)
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        assert (r2.usage.prompt_tokens, r2.usage.prompt_tokens_details.cached_tokens) == (len(ids2), len(ids1))
        assert r2.choices[0].message.content == want
        stats = serving.get_json(port, "/v1/stats")["state_cache"]
        assert stats["mode"] == "semantic" and stats["tokens_reused"] == len(ids1) and stats["hits"] == 1
    with serving.server(*args) as port:  # a restarted server: the disk tier holds turn 2's state
        ant = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="unused", max_retries=0)
        with ant.messages.stream(model="ftjax-default", system=turn1[0]["content"], messages=turn2[1:],
                                 max_tokens=10, extra_body={"temperature": 0}) as stream:
            m = stream.get_final_message()
        assert (m.usage.cache_read_input_tokens, m.usage.input_tokens) == (len(ids2), 0)
        assert m.content[0].text == want


@pytest.mark.parametrize("family", ["default_model", "hybrid_model"])
def test_the_newest_state_is_restored_whole_with_the_path_s_tokens(request, family):
    """A conversation snapshotted turn after turn (a deep path): the next request is
    restored from the newest snapshot's whole state (one copy), and continues exactly as
    the path's segments pasted together would."""
    model = request.getfixturevalue(family)
    rng = np.random.RandomState(7)
    ids = rng.randint(0, model.config.vocab_size, 120).tolist()
    cache = StateCache(model, "prefix", 1 << 30, 0)
    s = model.session()
    for end in range(20, 121, 20):  # six turns: a path of six nodes
        s.append(ids[len(s.ids):end])
        cache.insert(s)
    s.close()
    asked = ids + [5, 6, 7]
    hot, reused = cache.restore(asked)
    assert reused == 120 and cache.hit_kinds["newest"] == 1
    cache._hot = None  # the same request from the path's segments
    pasted, reused_path = cache.restore(asked)
    assert reused_path == 120 and cache.hit_kinds["newest"] == 1
    np.testing.assert_allclose(hot.append([5, 6, 7]), pasted.append([5, 6, 7]), rtol=1e-5, atol=1e-5)
