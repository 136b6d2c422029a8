"""DeepSeek-V3 (and the DeepSeek-style routing GLM-4.5 shares) against transformers and
against direct references: parity under every expert policy and for bf16 checkpoints,
other MLA geometries (plain q_proj, rotate-half RoPE, biases, YaRN with mscale), the
absorbed decode form of latent attention against the expanded form and a direct numpy
oracle, sessions (piecewise append, snapshot / resume, the state cache) on the latent
cache, group-limited sigmoid routing against a numpy reference, checkpoints carrying
multi-token-prediction layers, and the config values that must be refused."""

import copy

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

import ftjax
import hf_models
from ftjax.config import ConfigError
from ftjax.engine.session import Snapshot
from ftjax.engine.state_cache import StateCache
from ftjax.models import config_from_hf
from ftjax.models.common import route_sigmoid_group
from ftjax.models.mla import latent_attention
from test_parity import PROMPT, check_model, rel_err

POLICIES = {"device": {}, "host": {}, "lru": dict(cache_slots=6, bandwidth=(1.0, 2.0))}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    hf = hf_models.build("deepseek_v3", seed=7)
    return hf, hf_models.save(hf, tmp_path_factory.mktemp("deepseek"))


# ---- parity with transformers -------------------------------------------------------------

@pytest.mark.parametrize("policy", list(POLICIES))
def test_policies_match_transformers(deepseek, policy):
    hf, path = deepseek
    check_model(hf, path, policy=policy, threads=2, **POLICIES[policy])


def test_bf16_checkpoint(tmp_path):
    hf = hf_models.build("deepseek_v3", seed=8)
    path = hf_models.save(hf, tmp_path, dtype=torch.bfloat16)
    model = check_model(hf_models.bf16_rounded(hf), path, greedy=False)
    assert model.checkpoint.pool.dtype == "bfloat16" and model.checkpoint.packed
    unpacked = ftjax.load(path, dense_dtype="float32", numerics="exact")
    assert rel_err(model.logits(PROMPT), unpacked.logits(PROMPT)) <= 1e-5
    # released checkpoints keep the routers' correction bias in float32: still a bf16 checkpoint
    sd = load_file(str(path / "model.safetensors"))
    sd = {k: v.float() if k.endswith("e_score_correction_bias") else v for k, v in sd.items()}
    save_file(sd, str(path / "model.safetensors"))
    mixed = ftjax.load(path, numerics="exact")
    assert mixed.checkpoint.dtype == "bfloat16" and mixed.checkpoint.pool.dtype == "bfloat16" and mixed.checkpoint.packed
    np.testing.assert_array_equal(mixed.logits(PROMPT), model.logits(PROMPT))


YARN = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=16, mscale=0.707, mscale_all_dim=1.0,
            beta_fast=32, beta_slow=1, rope_theta=10000.0)


@pytest.mark.parametrize("overrides", [
    # plain q_proj, rotate-half RoPE, biases, unnormalised weights, one group, tied head, every layer MoE
    dict(q_lora_rank=None, rope_interleave=False, attention_bias=True, norm_topk_prob=False, n_group=1,
         topk_group=1, tie_word_embeddings=True, first_k_dense_replace=0, n_shared_experts=2),
    # YaRN: scaled frequencies, cos/sin times mscale / mscale_all_dim terms, softmax scale times mscale_all_dim²
    dict(rope_parameters=YARN, num_hidden_layers=4, first_k_dense_replace=2, v_head_dim=10),
])
def test_other_geometries(overrides, tmp_path):
    hf = hf_models.build("deepseek_v3", seed=9, **overrides)
    model = check_model(hf, hf_models.save(hf, tmp_path))
    if "rope_parameters" in overrides:
        cfg = model.config
        assert cfg.rope_scaling is not None and cfg.rope_scaling.attention_factor != 1.0
        assert cfg.mla.softmax_scale > (cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim) ** -0.5


# ---- latent attention: absorbed == expanded == direct ---------------------------------------

def direct_mla(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, positions, scale):
    """Numpy oracle: per-head K and V expanded over the whole cache, one softmax."""
    k_nope = np.einsum("bsr,rhd->bshd", c_kv, w_uk)  # [B, S, H, dn]
    v = np.einsum("bsr,rhd->bshd", c_kv, w_uv)
    scores = (np.einsum("bthd,bshd->bhts", q_nope, k_nope) + np.einsum("bthd,bsd->bhts", q_pe, k_pe)) * scale
    S = c_kv.shape[1]
    visible = np.arange(S)[None, None, None, :] <= positions[:, None, :, None]
    scores = np.where(visible, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v)


@pytest.mark.parametrize("T", [1, 5])
def test_absorbed_equals_expanded(T):
    B, S, H, R, dn, dr, dv = 2, 16, 3, 8, 6, 4, 5
    rng = np.random.RandomState(T)
    q_nope, q_pe = rng.randn(B, T, H, dn).astype(np.float32), rng.randn(B, T, H, dr).astype(np.float32)
    c_kv, k_pe = rng.randn(B, S, R).astype(np.float32), rng.randn(B, S, dr).astype(np.float32)
    w_uk, w_uv = rng.randn(R, H, dn).astype(np.float32), rng.randn(R, H, dv).astype(np.float32)
    start = np.array([3, 9], np.int32)  # rows at different positions; keys past start+T are never read
    positions = start[:, None] + np.arange(T, dtype=np.int32)
    c_kv[0, 3 + T:] = np.nan  # stale rows past the keys in use must not leak in
    want = direct_mla(q_nope, q_pe, np.nan_to_num(c_kv), k_pe, w_uk, w_uv, positions, 0.3)
    for block in (4, 16):  # several key blocks, and one
        forms = [np.asarray(latent_attention(*map(jnp.asarray, (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, positions)),
                                             jnp.asarray(start + T), 0.3, absorbed=absorbed, block=block))
                 for absorbed in (True, False)]
        for got in forms:
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(forms[0], forms[1], rtol=2e-5, atol=2e-5)


def test_decode_state_is_the_latent_cache(deepseek):
    _, path = deepseek
    model = ftjax.load(path, policy="host")
    cfg = model.config
    state = model.new_state(1, 32)
    assert all(set(layer) == {"c_kv", "k_pe"} for layer in state)
    assert state[0]["c_kv"].shape == (1, 32, cfg.mla.kv_lora_rank)
    assert state[0]["k_pe"].shape == (1, 32, cfg.mla.qk_rope_head_dim)


# ---- sessions and the state cache --------------------------------------------------------

def test_sessions_on_the_latent_cache(deepseek, tmp_path):
    _, path = deepseek
    model = ftjax.load(path, policy="lru", threads=2, **POLICIES["lru"])
    prompt = PROMPT + PROMPT[:10]
    ref_logits, ref_tokens = model.logits(prompt), model.generate(prompt, 8)
    tol = 2e-5 * np.abs(ref_logits).max()

    s = model.session()
    pieces = [prompt[:1], prompt[1:13], prompt[13:]]
    for i, piece in enumerate(pieces):
        end = sum(map(len, pieces[:i + 1]))
        np.testing.assert_allclose(s.append(piece), ref_logits[end - 1], atol=tol, rtol=0)
    snap = s.snapshot()
    assert s.generate(8) == ref_tokens
    cont = s.generate(6, temperature=0.9, top_p=0.9, seed=3)
    for restored in (model.session(snap), model.session(Snapshot.load(snap.save(tmp_path / "s")))):
        assert restored.position == len(prompt) and restored.ids == prompt
        assert restored.generate(8) == ref_tokens
        assert restored.generate(6, temperature=0.9, top_p=0.9, seed=3) == cont
    # rows at different positions decoded together: each row's latents written and read at its own position
    short = prompt[:7]
    assert model.generate_many([prompt, short], 8) == [ref_tokens, model.generate(short, 8)]


def test_state_cache_reuses_latent_segments(deepseek):
    _, path = deepseek
    model = ftjax.load(path, policy="host")
    cache = StateCache(model, "prefix")
    first = PROMPT + [5, 6, 7, 8]
    cache.prefill(first)
    second = first[:15] + [40, 41, 42]  # shares 15 tokens, then changes
    s, reused = cache.prefill(second)
    assert reused == 15  # every leaf is per-token: reuse up to the first changed token
    assert s.generate(8) == model.generate(second, 8)


# ---- routing ---------------------------------------------------------------------------------

def numpy_group_route(logits, bias, top_k, n_group, topk_group, normalize, scale):
    """The DeepSeek-V3 router, written out per token."""
    N, E = logits.shape
    size = E // n_group
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    ids, weights = [], []
    for n in range(N):
        biased = scores[n] + bias
        group_score = [np.sort(biased[g * size:(g + 1) * size])[-2:].sum() for g in range(n_group)]
        kept = np.argsort(group_score)[::-1][:topk_group]
        eligible = [e for e in range(E) if e // size in kept]
        chosen = sorted(eligible, key=lambda e: -biased[e])[:top_k]
        w = scores[n, chosen]
        if normalize:
            w = w / w.sum()
        ids.append(chosen)
        weights.append(w * scale)
    return np.array(ids), np.array(weights)


@pytest.mark.parametrize("n_group,topk_group,normalize", [(4, 2, True), (8, 3, False), (1, 1, True)])
def test_group_routing_matches_numpy(n_group, topk_group, normalize):
    rng = np.random.RandomState(n_group)
    N, E, K = 64, 16, 4
    logits, bias = rng.randn(N, E).astype(np.float32) * 2, rng.randn(E).astype(np.float32) * 0.5
    ids, weights = route_sigmoid_group(jnp.asarray(logits), jnp.asarray(bias), K, n_group, topk_group, normalize, 2.5)
    want_ids, want_w = numpy_group_route(logits, bias, K, n_group, topk_group, normalize, 2.5)
    ids, weights = np.asarray(ids), np.asarray(weights)
    assert ids.dtype == np.int32 and ids.shape == weights.shape == (N, K)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=1e-5)
    if n_group > 1:  # the group limit and the bias both change the choice for some tokens
        assert any(set(i) != set(np.argsort(-(logits[n] + bias))[:K]) for n, i in enumerate(ids))
    assert any(set(i) != set(np.argsort(-logits[n])[:K]) for n, i in enumerate(ids))


# ---- checkpoints and configs ---------------------------------------------------------------

def test_mtp_layer_tensors_are_skipped(deepseek, tmp_path, capsys):
    hf, path = deepseek
    L = hf.config.num_hidden_layers
    sd = load_file(str(path / "model.safetensors"))
    for name in [n for n in sd if n.startswith(f"model.layers.{L - 1}.")]:  # an MTP layer is a decoder layer + extras
        sd[name.replace(f"layers.{L - 1}.", f"layers.{L}.")] = sd[name].clone()
    sd[f"model.layers.{L}.eh_proj.weight"] = torch.zeros(32, 64)
    sd[f"model.layers.{L}.enorm.weight"] = torch.ones(32)
    out = tmp_path / "mtp"
    out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    save_file(sd, str(out / "model.safetensors"))
    model = ftjax.load(out)
    assert "multi-token-prediction" in capsys.readouterr().err
    assert rel_err(model.logits(PROMPT), hf_models.hf_logits(hf, PROMPT).numpy()) <= 1e-4


def _hf_dict(family: str) -> dict:
    """The config.json of the tiny test model (no weights built)."""
    return copy.deepcopy(AutoConfig.for_model(family, **{**hf_models.BASE, **hf_models.FAMILY_CONFIGS[family]}).to_dict())


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("change,named", [
    (dict(topk_method="greedy"), "'greedy'"),
    (dict(scoring_func="softmax"), "'softmax'"),
    (dict(moe_layer_freq=2), "moe_layer_freq 2"),
    (dict(quantization_config={"quant_method": "fp8"}), "'fp8'"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}), "'llama3'"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), "'dynamic'"),
    (dict(n_group=3), "n_group"),  # 8 experts do not split into 3 groups
    (dict(topk_group=9), "topk_group"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok"),  # 1 group of 2 < 3 experts
    (dict(hidden_act="gelu"), "'gelu'"),
])
def test_unsupported_configs_raise(family, change, named):
    hf = {**_hf_dict(family), **change}
    with pytest.raises(ConfigError, match=named):
        config_from_hf(hf)


def test_deepseek_config_fields():
    cfg = config_from_hf(_hf_dict("deepseek_v3"))
    assert cfg.router == "sigmoid_group" and (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (4, 2, 2.5)
    assert cfg.layer_kinds == ("mla",) * 3 and cfg.moe_layers == (False, True, True)
    assert cfg.shared_expert_d_ff == 16 and not cfg.shared_expert_gate and cfg.rope_dim == 4
    assert cfg.mla.q_lora_rank == 12 and cfg.mla.rope_interleave
    assert cfg.mla.softmax_scale == pytest.approx(12 ** -0.5)
    legacy = {**_hf_dict("deepseek_v3"), "rope_parameters": None, "rope_theta": 10000.0,
              "rope_scaling": dict(type="yarn", factor=40, mscale=1.0, mscale_all_dim=1.0,
                                   original_max_position_embeddings=64)}
    cfg = config_from_hf(legacy)  # the v4 spelling real DeepSeek-V3 config.json files use
    assert cfg.rope_scaling.factor == 40 and cfg.rope_scaling.attention_factor == pytest.approx(1.0)
    assert cfg.mla.softmax_scale == pytest.approx(12 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)
