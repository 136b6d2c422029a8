"""Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5/3.6-MoE).

The chunked delta rule against the per-token recurrence and transformers' reference;
padding and idle rows leave the state alone; sessions on a hybrid checkpoint (every
expert policy against transformers, piecewise append across chunk boundaries,
snapshot/resume, batched decode, streamed prefill); the multimodal checkpoint layout;
config errors; the CLI on such a folder."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import ftjax
import hf_models
from ftjax import cli
from ftjax.config import ConfigError
from ftjax.models import config_from_hf, deltanet
from test_parity import check_model, rel_err

PROMPT = [int(t) for t in np.random.RandomState(1).randint(0, 96, size=150)]  # crosses two 64-token chunks


def _inputs(T, B=2, Hk=2, r=2, dk=8, dv=6, seed=0):
    rng = np.random.default_rng(seed)
    H = Hk * r
    q = deltanet.l2_normalize(jnp.asarray(rng.normal(size=(B, T, H, dk)), jnp.float32)) * dk**-0.5
    k = deltanet.l2_normalize(jnp.asarray(rng.normal(size=(B, T, H, dk)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(B, T, H, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 0.5, size=(B, T, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, size=(B, T, H)), jnp.float32)
    state = jnp.asarray(rng.normal(size=(B, H, dk, dv)), jnp.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T", [1, 7, 64, 130])
def test_chunked_equals_recurrent(T):
    args = _inputs(T, seed=T)
    want_out, want_state = deltanet.recurrent_delta_rule(*args)
    got_out, got_state = deltanet.chunked_delta_rule(*args)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_state, want_state, rtol=1e-5, atol=1e-5)
    small_out, _ = deltanet.chunked_delta_rule(*args, chunk=16)  # any chunk size, same function
    np.testing.assert_allclose(small_out, want_out, rtol=1e-5, atol=1e-5)


def test_unit_lower_inverse():
    rng = np.random.default_rng(7)
    lower = np.tril(rng.uniform(-1, 1, size=(3, 16, 16)), -1).astype(np.float32)
    want = np.linalg.inv(np.eye(16, dtype=np.float32) + lower)
    np.testing.assert_allclose(deltanet.unit_lower_inverse(jnp.asarray(lower)), want, rtol=1e-4, atol=1e-4)


def test_recurrence_matches_transformers_reference():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    q, k, v, g, beta, state = _inputs(20, seed=3)
    raw_q = q / 8**-0.5  # transformers normalises and scales q itself (use_qk_l2norm_in_kernel)
    t = lambda a: torch.from_numpy(np.array(a))  # noqa: E731  (a writable copy for torch)
    want, want_state = torch_recurrent_gated_delta_rule(t(raw_q), t(k), t(v), t(g), t(beta), initial_state=t(state),
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    got, got_state = deltanet.chunked_delta_rule(q, k, v, g, beta, state)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_state, want_state.numpy(), rtol=1e-4, atol=1e-5)


def test_padding_leaves_state_untouched():
    """beta = g = 0 past a row's valid tokens (what the layer sets for padding and idle
    rows) gives the state after the valid tokens only; the conv state likewise."""
    q, k, v, g, beta, state = _inputs(40, B=1, seed=5)
    n = 23
    keep = (jnp.arange(40) < n)[None, :, None]
    _, masked = deltanet.chunked_delta_rule(q, k, v, jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0), state)
    _, prefix = deltanet.recurrent_delta_rule(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], state)
    np.testing.assert_allclose(masked, prefix, rtol=1e-5, atol=1e-5)

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 9, 5)), jnp.float32)  # [B, T, C]
    conv0 = jnp.asarray(rng.normal(size=(2, 3, 5)), jnp.float32)  # K = 4
    w = jnp.asarray(rng.normal(size=(5, 1, 4)), jnp.float32)
    out, conv = deltanet.causal_conv(x, conv0, w, jnp.array([9, 4]))
    full = np.concatenate([np.asarray(conv0), np.asarray(x)], axis=1)
    np.testing.assert_allclose(conv[0], full[0, 9:12])
    np.testing.assert_allclose(conv[1], full[1, 4:7])  # row 1: only its first 4 tokens count
    direct = sum(full[:, j:j + 9] * np.asarray(w)[:, 0, j] for j in range(4))
    np.testing.assert_allclose(out, jax.nn.silu(direct), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- sessions on a hybrid checkpoint

@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    hf = hf_models.build("qwen3_5_moe_text", seed=11, max_position_embeddings=512)
    return hf, hf_models.save(hf, tmp_path_factory.mktemp("hybrid"))


@pytest.mark.parametrize("policy", ["device", "host", "lru"])
def test_policies_match_transformers(hybrid, policy):
    hf, path = hybrid
    kw = {"cache_slots": 14, "bandwidth": (1.0, 2.0)} if policy == "lru" else {}  # B_P / B_H given: no profile
    model = check_model(hf, path, tol=2e-4, prompt=PROMPT[:40], policy=policy, **kw)
    assert rel_err(model.logits(PROMPT), hf_models.hf_logits(hf, PROMPT).numpy()) <= 2e-4
    if policy == "lru":
        stats = model.stats()
        assert stats["misses"] > 0 and stats["hits"] > 0


def test_piecewise_append_equals_whole(hybrid):
    hf, path = hybrid
    model = ftjax.load(path, prefill_chunk=64)  # the 150-token prompt prefills in 3 engine chunks
    whole = model.session()
    logits_whole = whole.logits(PROMPT)
    pieces = model.session()
    parts = [pieces.logits(PROMPT[:50]), pieces.logits(PROMPT[50:51]), pieces.logits(PROMPT[51:])]
    assert rel_err(np.concatenate(parts), logits_whole) <= 5e-5  # other chunk boundaries: f32 rounding only
    assert rel_err(logits_whole, hf_models.hf_logits(hf, PROMPT).numpy()) <= 2e-4
    assert pieces.generate(10) == whole.generate(10)


def test_snapshot_resume_continues_identically(hybrid, tmp_path):
    _, path = hybrid
    model = ftjax.load(path)
    s = model.session()
    s.append(PROMPT[:70])
    snap = s.snapshot()
    assert {"conv", "ssm"} <= set(snap.state[0])  # the recurrent layers' state is in the snapshot
    resumed = model.session(type(snap).load(snap.save(tmp_path / "snap")))
    s.append(PROMPT[70:90])
    resumed.append(PROMPT[70:90])
    assert resumed.generate(12) == s.generate(12)


def test_batched_decode_equals_one_at_a_time(hybrid):
    _, path = hybrid
    model = ftjax.load(path, policy="host")
    prompts = [PROMPT[:5], PROMPT[:37], PROMPT[10:90]]
    together = model.generate_many(prompts, 8)
    assert together == [model.generate(p, 8) for p in prompts]


def test_server_scheduler_rows_match_generate(hybrid):
    """The serving scheduler's continuous batching (rows joining a running batch, prompts
    prefilled in chunks between decode steps) on a hybrid: each request gets exactly what
    a lone generate gives it."""
    from ftjax.engine.scheduler import Job, Scheduler
    from ftjax.engine.session import Sampling

    _, path = hybrid
    model = ftjax.load(path, policy="host")
    prompts, lengths = [PROMPT[:9], PROMPT[20:90], PROMPT[5:40]], [10, 6, 12]
    want = [model.generate(p, n) for p, n in zip(prompts, lengths)]
    sch, outs = Scheduler(model, max_batch=2, prefill_chunk=16), []
    for p, n in zip(prompts, lengths):
        out = []
        outs.append(out)
        sch.submit(Job(np.asarray(p, np.int32), n, Sampling(), on_token=lambda t, out=out: out.append(t) and False,
                       on_done=lambda r: None))
        sch.step()
    while sch.busy():
        sch.step()
    assert outs == want


def test_streamed_prefill_matches(hybrid):
    hf, path = hybrid
    model = ftjax.load(path, policy="lru", cache_slots=4, bandwidth=(1.0, 2.0), prefill="streamed")
    assert rel_err(model.logits(PROMPT), hf_models.hf_logits(hf, PROMPT).numpy()) <= 2e-4
    assert model.stats()["bytes_streamed"] > 0


def test_state_does_not_grow_with_context(hybrid):
    _, path = hybrid
    model = ftjax.load(path)
    small, large = model.new_state(1, 64), model.new_state(1, 512)
    for layer, kind in enumerate(model.config.layer_kinds):
        sizes = [sum(a.size for a in jax.tree.leaves(s[layer])) for s in (small, large)]
        assert (sizes[0] == sizes[1]) == (kind == "gated_deltanet")


# ---------------------------------------------------------------- the multimodal checkpoint layout

def _multimodal(tmp_path, vocab_size=96):
    from transformers import AutoConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(0)
    text = {**hf_models.BASE, **hf_models.HYBRID, "vocab_size": vocab_size}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                  num_position_embeddings=16)
    cfg = AutoConfig.for_model("qwen3_5_moe", text_config=text, vision_config=vision, tie_word_embeddings=False)
    model = Qwen3_5MoeForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return model, tmp_path


def test_multimodal_layout_loads_the_text_model(tmp_path, capsys):
    hf, path = _multimodal(tmp_path)
    model = ftjax.load(path)
    assert "images are not supported" in capsys.readouterr().err
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT[:30]])).logits[0].numpy()
    assert rel_err(model.logits(PROMPT[:30]), want) <= 2e-4


def test_cli_generates_on_a_multimodal_folder(tmp_path, capsys):
    from ftjax.tokenizer import Tokenizer

    from test_cli import DEFAULT_DIR, TOKENIZER_FILES

    _, path = _multimodal(tmp_path, vocab_size=Tokenizer.from_dir(DEFAULT_DIR).vocab_size)
    for f in TOKENIZER_FILES:
        shutil.copy(DEFAULT_DIR / f, path / f)
    assert cli.main(["generate", "--model", str(path), "The sea", "-n", "5", "--json", "--policy", "host"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["new_tokens"] == 5 and "images are not supported" in captured.err


# ---------------------------------------------------------------- config errors

def _hybrid_config(**overrides):
    hf = {**hf_models.BASE, **hf_models.HYBRID, "model_type": "qwen3_5_moe_text", "hidden_act": "silu", **overrides}
    return {k: v for k, v in hf.items() if v is not None}


@pytest.mark.parametrize("overrides,message", [
    (dict(layer_types=["linear_attention", "sliding_attention", "full_attention", "linear_attention"]),
     "sliding_attention"),
    (dict(layer_types=["full_attention"]), "layer_types must list 4"),
    (dict(linear_num_key_heads=3), "not a multiple of linear_num_key_heads"),
    (dict(linear_key_head_dim=0), "linear_key_head_dim"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.0}), "partial_rotary_factor"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.375}), "rotary_dim"),
])
def test_bad_hybrid_configs_are_named(overrides, message):
    from ftjax.config import validate

    with pytest.raises(ConfigError, match=message):
        validate(config_from_hf(_hybrid_config(**overrides)))


def test_hybrid_config_fields():
    cfg = config_from_hf(_hybrid_config())
    assert cfg.layer_kinds == ("gated_deltanet",) * 3 + ("gated_attention",)
    assert cfg.norm_offset == 1.0 and cfg.rotary_dim == 2 and cfg.shared_expert_gate  # head_dim 8 x 0.25
    assert cfg.deltanet.num_v_heads == 4 and not cfg.deltanet.fused_qkvz
    nxt = config_from_hf(_hybrid_config(model_type="qwen3_next", full_attention_interval=2, layer_types=None))
    assert nxt.deltanet.fused_qkvz and nxt.layer_kinds == ("gated_deltanet", "gated_attention") * 2
