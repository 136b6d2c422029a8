"""GLM-5 (glm_moe_dsa: DeepSeek sparse attention over a latent cache) against transformers
and against direct references: parity and greedy tokens under every expert policy, with
prompts far longer than the indexer's top-k (6) so each query, in prefill and in every
decode step, attends a strict subset of its keys; bf16 and fused-expert checkpoints; the
indexer and the masked latent attention against numpy oracles; sessions (piecewise
append, snapshot / resume, batched rows at different positions, the state cache) on the
latent + indexer-key cache; GLM-5.2's IndexShare (layers reusing the previous indexer's
selection); the config fields and the values that must be refused.

test_parity's per-family tests cover glm_moe_dsa too (hf_models.FAMILY_CONFIGS): parity
and greedy tokens on a 20-token prompt, and the packed bf16 checkpoint."""

import copy

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoConfig

import ftjax
import hf_models
from ftjax.config import ConfigError
from ftjax.engine.session import Snapshot
from ftjax.engine.state_cache import StateCache
from ftjax.models import config_from_hf
from ftjax.models.dsa import index_scores, top_k_keep
from ftjax.models.mla import latent_attention
from test_parity import PROMPT, check_model, rel_err

FAMILY = "glm_moe_dsa"
TOPK = hf_models.FAMILY_CONFIGS[FAMILY]["index_topk"]
LONG = PROMPT + PROMPT[3:19]  # 36 tokens: from position 6 on, every query drops keys
POLICIES = {"device": {}, "host": {}, "lru": dict(cache_slots=6, bandwidth=(1.0, 2.0))}


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    hf = hf_models.build(FAMILY, seed=7)
    return hf, hf_models.save(hf, tmp_path_factory.mktemp("glm5"))


@pytest.fixture(scope="module")
def reference(glm5):
    """transformers' logits of LONG and its 20 greedy tokens (computed once)."""
    hf, _ = glm5
    return hf_models.hf_logits(hf, LONG).numpy(), hf_models.hf_greedy(hf, LONG, 20)


# ---- parity with transformers -------------------------------------------------------------

def check_against(model, reference, tol=2e-4):
    """Logits of LONG, greedy tokens, and each decode step's logits against the full forward."""
    hf_models.check_against(model, reference, LONG, tol)


def test_the_reference_drops_keys(glm5, reference):
    """transformers with a top-k above the prompt length (dense MLA) gives other logits, so
    the parity below holds only if ftjax drops the same keys, in prefill and in decode."""
    hf, _ = glm5
    indexers = [layer.self_attn.indexer for layer in hf.model.layers]
    try:
        for indexer in indexers:
            indexer.index_topk = 4096
        dense = hf_models.hf_logits(hf, LONG + reference[1]).numpy()
    finally:
        for indexer in indexers:
            indexer.index_topk = TOPK
    assert rel_err(dense[:len(LONG)], reference[0]) > 1e-2
    np.testing.assert_allclose(dense[:TOPK], reference[0][:TOPK], rtol=1e-5, atol=1e-5)  # up to k keys: all kept
    sparse = hf_models.hf_logits(hf, LONG + reference[1]).numpy()
    assert rel_err(dense[len(LONG):], sparse[len(LONG):]) > 1e-2  # the decode positions too


def test_device_policy_and_sessions(glm5, reference, tmp_path):
    """Parity and greedy tokens, then sessions on the latent + indexer-key cache: piecewise
    append equals the whole prompt (the second piece's queries select among keys of the
    first), snapshot / resume (in memory and from disk) continues identically."""
    _, path = glm5
    model = ftjax.load(path, policy="device")
    check_against(model, reference)
    hf_models.check_sessions(model, reference, LONG, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "host"])
def test_other_policies_match_transformers(glm5, reference, policy, tmp_path):
    _, path = glm5
    model = ftjax.load(path, policy=policy, threads=2, **POLICIES[policy])
    check_against(model, reference)
    s = model.session()
    s.append(LONG)
    snap = s.snapshot()
    cont = s.generate(6, temperature=0.9, top_p=0.9, seed=3)  # sampled continuations resume identically too
    for restored in (model.session(snap), model.session(Snapshot.load(snap.save(tmp_path / "s")))):
        assert restored.generate(6, temperature=0.9, top_p=0.9, seed=3) == cont


@pytest.mark.slow
def test_batched_rows_and_the_state_cache(glm5, reference):
    _, path = glm5
    model = ftjax.load(path, policy="host")
    short = LONG[:9]  # rows at different positions decoded together: each row selects among its own keys
    assert model.generate_many([LONG, short], 8) == [reference[1][:8], model.generate(short, 8)]
    cache = StateCache(model, "prefix")
    cache.prefill(LONG + [5, 6, 7, 8])
    second = LONG[:25] + [40, 41, 42]  # shares 25 tokens, then changes
    restored, reused = cache.prefill(second)
    assert reused == 25  # every leaf, the indexer keys too, is per-token
    assert restored.generate(8) == model.generate(second, 8)


@pytest.mark.slow
def test_bf16_and_fused_checkpoints(tmp_path):
    """On LONG (the default suite's bf16 check is test_parity's packed-bf16 test, which
    covers glm_moe_dsa with greedy tokens): packed bf16 against transformers on the rounded
    weights and against the float32 layout, and the fused expert layout."""
    hf = hf_models.build(FAMILY, seed=8)
    path = hf_models.save(hf, tmp_path / "bf16", dtype=torch.bfloat16)
    model = check_model(hf_models.bf16_rounded(hf), path, greedy=False, prompt=LONG, tol=2e-4)
    assert model.checkpoint.pool.dtype == "bfloat16" and model.checkpoint.packed
    unpacked = ftjax.load(path, dense_dtype="float32")
    assert rel_err(model.logits(LONG), unpacked.logits(LONG)) <= 1e-5
    check_model(hf, hf_models.save(hf, tmp_path / "fused", fused=True), greedy=False, prompt=LONG, tol=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    # biases, unnormalised weights, one group, every layer MoE, 16 narrower indexer heads keeping 11 keys
    # (with few heads, keys whose every relu is zero tie at score 0, and torch.topk orders ties its own way)
    dict(attention_bias=True, norm_topk_prob=False, n_group=1, topk_group=1, first_k_dense_replace=0,
         n_shared_experts=2, index_n_heads=16, index_head_dim=8, index_topk=11),
    # YaRN: scaled frequencies (indexer RoPE too), softmax scale times mscale_all_dim²; dense layers by mlp_layer_types
    dict(rope_parameters=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=16, mscale=0.707,
                              mscale_all_dim=1.0, beta_fast=32, beta_slow=1, rope_theta=10000.0),
         num_hidden_layers=4, mlp_layer_types=["dense", "sparse", "dense", "sparse"], v_head_dim=10),
])
def test_other_geometries(overrides, tmp_path):
    hf = hf_models.build(FAMILY, seed=9, **overrides)
    model = check_model(hf, hf_models.save(hf, tmp_path), prompt=LONG, tol=2e-4)
    if "mlp_layer_types" in overrides:
        assert model.config.moe_layers == (False, True, False, True)


# Geometries where the indexer's top-k sits below the prompt and, with few heads, keys tie
# at score 0 (every head's relu vanishing): the selection is one rule (ties lowest position
# first), the same in every chunking, and the reference is given that rule.
TIED_GEOMETRIES = [
    dict(index_n_heads=4),
    dict(index_n_heads=2, index_head_dim=32, q_lora_rank=20),
    dict(index_n_heads=4, num_hidden_layers=2, first_k_dense_replace=0, kv_lora_rank=24, index_topk=3,
         qk_rope_head_dim=8, qk_nope_head_dim=12),
]


@pytest.mark.parametrize("overrides", TIED_GEOMETRIES, ids=["h4", "h2-d32-q20", "h4-k3-r8-moe-first"])
def test_tied_selections_match_transformers_and_every_chunking(overrides, tmp_path):
    hf = hf_models.build(FAMILY, seed=7, **overrides)
    with hf_models.stable_topk() as ties:
        reference = hf_models.hf_logits(hf, LONG).numpy(), hf_models.hf_greedy(hf, LONG, 8)
    assert any(ties)  # the reference met keys tied at the k-th score: the case under test
    path = hf_models.save(hf, tmp_path)
    model = ftjax.load(path)
    hf_models.check_against(model, reference, LONG)
    whole = model.logits(LONG)
    for split in (5, 17, 30):  # a session fed in two pieces
        s = model.session()
        s.append(LONG[:split])
        assert rel_err(s.logits(LONG[split:]), whole[split:]) <= 1e-5
    assert rel_err(ftjax.load(path, prefill_chunk=7).logits(LONG), whole) <= 1e-5  # chunked prefill


# ---- the indexer and the masked attention against numpy --------------------------------------

def numpy_keep(q, w, keys, positions, scale, k):
    """Per query: the k visible keys of highest Σ_h w_h relu(q_h·k scale), ties to lower positions."""
    B, T = positions.shape
    S = keys.shape[1]
    scores = np.einsum("bth,bths->bts", w, np.maximum(np.einsum("bthd,bsd->bths", q, keys) * scale, 0))
    keep = np.zeros((B, T, S), bool)
    for b in range(B):
        for t in range(T):
            visible = np.arange(positions[b, t] + 1)
            order = sorted(visible, key=lambda s: (-scores[b, t, s], s))
            keep[b, t, order[:k]] = True
    return keep


def test_indexer_selection_matches_numpy():
    B, T, S, Hi, di, k = 2, 5, 32, 3, 6, 4
    rng = np.random.RandomState(0)
    q, keys = rng.randn(B, T, Hi, di).astype(np.float32), rng.randn(B, S, di).astype(np.float32)
    w = rng.randn(B, T, Hi).astype(np.float32)
    start = np.array([2, 20], np.int32)  # row 0: early queries see fewer than k keys
    positions = start[:, None] + np.arange(T, dtype=np.int32)
    keys[0, 2 + T:] = np.nan  # rows past the keys in use must not leak in
    want = numpy_keep(q, w, np.nan_to_num(keys), positions, 0.4, k)
    for block in (8, 32):
        scores = index_scores(*map(jnp.asarray, (q, w, keys, positions)), jnp.asarray(start + T), 0.4, block=block)
        keep = np.asarray(top_k_keep(scores, k)) & (np.arange(S) <= positions[..., None])
        np.testing.assert_array_equal(keep, want)
    assert (want.sum(-1) == np.minimum(positions + 1, k)).all()
    ties = np.zeros((1, 1, 8), np.float32)  # equal scores: the lowest positions are kept
    np.testing.assert_array_equal(np.asarray(top_k_keep(jnp.asarray(ties), 3))[0, 0], np.arange(8) < 3)
    mixed = np.array([[[0.5, 0, -1, 0, 2, 0, 0, -np.inf]]], np.float32)  # 2 above the tie at 0, 4 tied
    np.testing.assert_array_equal(np.asarray(top_k_keep(jnp.asarray(mixed), 4))[0, 0],
                                  [True, True, False, True, True, False, False, False])


def direct_sparse_mla(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, positions, scale, keep):
    k_nope, v = np.einsum("bsr,rhd->bshd", c_kv, w_uk), np.einsum("bsr,rhd->bshd", c_kv, w_uv)
    scores = (np.einsum("bthd,bshd->bhts", q_nope, k_nope) + np.einsum("bthd,bsd->bhts", q_pe, k_pe)) * scale
    visible = (np.arange(c_kv.shape[1])[None, None, :] <= positions[:, :, None]) & keep  # [B, T, S]
    scores = np.where(visible[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)


def test_masked_latent_attention():
    B, S, H, R, dn, dr, dv = 2, 16, 3, 8, 6, 4, 5
    rng = np.random.RandomState(1)
    c_kv, k_pe = rng.randn(B, S, R).astype(np.float32), rng.randn(B, S, dr).astype(np.float32)
    w_uk, w_uv = rng.randn(R, H, dn).astype(np.float32), rng.randn(R, H, dv).astype(np.float32)
    start = np.array([3, 9], np.int32)
    for T, absorbed in ((1, True), (5, False)):  # decode and prefill forms, several key blocks
        q_nope, q_pe = rng.randn(B, T, H, dn).astype(np.float32), rng.randn(B, T, H, dr).astype(np.float32)
        positions = start[:, None] + np.arange(T, dtype=np.int32)
        keep = rng.rand(B, T, S) < 0.5
        keep[np.arange(B)[:, None], np.arange(T)[None, :], positions] = True  # every query keeps a key
        want = direct_sparse_mla(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, positions, 0.3, keep)
        got = latent_attention(*map(jnp.asarray, (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, positions)),
                               jnp.asarray(start + T), 0.3, absorbed=absorbed, block=4, keep=jnp.asarray(keep))
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


# ---- sessions and the state cache --------------------------------------------------------

def test_state_holds_the_indexer_keys(glm5):
    _, path = glm5
    model = ftjax.load(path, policy="host")
    cfg = model.config
    state = model.new_state(1, 32)
    assert all(set(layer) == {"c_kv", "k_pe", "idx_k"} for layer in state)
    assert state[0]["idx_k"].shape == (1, 32, cfg.dsa.index_head_dim)
    assert state[0]["c_kv"].shape == (1, 32, cfg.mla.kv_lora_rank)


# ---- checkpoints and configs ---------------------------------------------------------------

def _hf_dict(**overrides) -> dict:
    """The config.json of the tiny test model (no weights built)."""
    kw = {**hf_models.BASE, **hf_models.FAMILY_CONFIGS[FAMILY], **overrides}
    return copy.deepcopy(AutoConfig.for_model(FAMILY, **kw).to_dict())


def test_config_fields():
    cfg = config_from_hf(_hf_dict())
    assert cfg.layer_kinds == ("mla_dsa",) * 3 and cfg.moe_layers == (False, True, True)
    assert (cfg.dsa.index_n_heads, cfg.dsa.index_head_dim, cfg.dsa.index_topk) == (8, 12, 6)
    assert cfg.router == "sigmoid_group" and (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (4, 2, 2.5)
    assert cfg.mla.q_lora_rank == 12 and cfg.mla.rope_interleave and cfg.rope_dim == 4 and cfg.head_dim == 12
    assert cfg.mla.softmax_scale == pytest.approx(12 ** -0.5)
    real = AutoConfig.for_model(FAMILY).to_dict()  # transformers' defaults are GLM-5's config
    cfg = config_from_hf(real)
    assert (cfg.dsa.index_n_heads, cfg.dsa.index_head_dim, cfg.dsa.index_topk) == (32, 128, 2048)
    assert cfg.moe_layers[:4] == (False, False, False, True) and cfg.num_experts == 256


def test_index_share_matches_transformers(tmp_path):
    """GLM-5.2's IndexShare: layers 1 and 3 have no indexer and attend the keys the full
    layer before them selected (transformers' prev_topk_indices), in prefill and in every
    decode step, under `device` and `host`; such a model cannot stream one layer per
    program (the selection passes between layers in one trace)."""
    hf = hf_models.build(FAMILY, seed=11, num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"])
    path = hf_models.save(hf, tmp_path)
    model = check_model(hf, path, prompt=LONG, tol=2e-4)
    assert [model.config.layer_kind(i) for i in range(4)] == ["mla_dsa", "mla_dsa_shared"] * 2
    assert set(model.new_state(1, 8)[1]) == {"c_kv", "k_pe"}  # no indexer key cache on a shared layer
    host = check_model(hf, path, prompt=LONG, tol=2e-4, policy="host")
    assert host._streamed is None
    with pytest.raises(ValueError, match="streamed"):
        ftjax.load(path, policy="host", prefill="streamed")


@pytest.mark.parametrize("change,named", [
    (dict(indexer_types=["full", "dense", "full"]), "'dense'"),
    (dict(indexer_types=["shared", "full", "full"]), "first layer must be 'full'"),
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(index_head_dim=2), "index_head_dim"),  # narrower than the RoPE dims
    (dict(index_topk=0), "index_topk"),
    (dict(topk_method="greedy"), "'greedy'"),
    (dict(quantization_config={"quant_method": "fp8"}), "'fp8'"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}), "'llama3'"),
])
def test_unsupported_configs_raise(change, named):
    hf = {**_hf_dict(), **change}
    if "index_topk_freq" in change:  # raw config.json spelling: transformers derives indexer_types from it
        hf.pop("indexer_types")
    with pytest.raises(ConfigError, match=named):
        config_from_hf(hf)
