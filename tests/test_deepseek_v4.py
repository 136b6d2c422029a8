"""DeepSeek-V4 (deepseek_v4: sliding-window, heavily compressed and compressed-sparse
attention, hyper-connections, hash and score-top-k routing, clamped SwiGLU) against
transformers: logits, greedy tokens and decode-step logits under every expert policy,
with prompts long enough that every mechanism acts (a 6-token window on 36 tokens, HCA
entries every 8 tokens, CSA entries every 4 of which the indexer keeps 3); bf16
checkpoints; sessions on the per-layer state (piecewise append, snapshot / resume,
batched rows at different positions, the state cache); the config fields and the values
that must be refused.

The tiny random checkpoints are built offline with transformers and saved with
save_pretrained, which writes the original DeepSeek tensor names (`layers.{i}.attn.wq_a`,
`ffn.experts.{e}.w1`, `hc_attn_fn`, ...): those are what the loader reads here."""

import copy

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import ftjax
import hf_models
from ftjax.config import ConfigError
from ftjax.engine.session import Snapshot
from ftjax.engine.state_cache import StateCache
from ftjax.models import config_from_hf
from ftjax.models.deepseek_v4 import route_hash, route_scores, route_top_k
from test_parity import PROMPT, rel_err

FAMILY = "deepseek_v4"
LONG = PROMPT + PROMPT[3:19]  # 36 tokens
POLICIES = {"device": {}, "host": {}, "lru": dict(cache_slots=6, bandwidth=(1.0, 2.0))}
# 3 layers: sliding (hash-routed), compressed-sparse, heavily compressed; 3 hyper-connection streams
CONFIG = dict(hf_models.BASE, num_hidden_layers=3, num_key_value_heads=1, head_dim=16, partial_rotary_factor=0.25,
              q_lora_rank=12, o_groups=2, o_lora_rank=8, n_routed_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=16, n_shared_experts=1, sliding_window=6, index_n_heads=16, index_head_dim=8,
              index_topk=3, hc_mult=3, hc_sinkhorn_iters=20, routed_scaling_factor=1.5,
              layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
              mlp_layer_types=["hash_moe", "moe", "moe"])


def build(seed: int = 0, **overrides):
    """A tiny random DeepseekV4ForCausalLM whose every parameter matters: the parameters
    transformers initialises to constants (sinks, position biases, mHC biases and scales)
    and the norms are perturbed, the hash table names distinct experts per token, the
    router's correction bias is bf16-exact."""
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(FAMILY, **{**CONFIG, **overrides})
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            if name.endswith((".scale", "hc_scale")):
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_((0.1 * torch.randn(b.shape, generator=g)).to(torch.bfloat16).float())
            if name.endswith("tid2eid"):
                V, K = b.shape
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:K] for _ in range(V)]))
    return model


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory):
    hf = build(seed=7)
    return hf, hf_models.save(hf, tmp_path_factory.mktemp("dsv4"))


@pytest.fixture(scope="module")
def reference(dsv4):
    """transformers' logits of LONG and its 20 greedy tokens (computed once)."""
    hf, _ = dsv4
    return hf_models.hf_logits(hf, LONG).numpy(), hf_models.hf_greedy(hf, LONG, 20)


def check_against(model, reference, tol=2e-4):
    """Logits of LONG, greedy tokens, and each decode step's logits against the full forward."""
    hf_models.check_against(model, reference, LONG, tol)


# ---- parity with transformers -------------------------------------------------------------

def test_the_reference_uses_every_mechanism(dsv4, reference):
    """The parity below is informative: with the indexer keeping every entry, or without
    the sinks, transformers' logits change (so ftjax drops the same compressed entries and
    weighs the sink as transformers does)."""
    hf, _ = dsv4
    indexer = hf.model.layers[1].self_attn.compressor.indexer
    try:
        indexer.index_topk = 4096
        dense = hf_models.hf_logits(hf, LONG).numpy()
    finally:
        indexer.index_topk = CONFIG["index_topk"]
    assert rel_err(dense, reference[0]) > 1e-3
    np.testing.assert_allclose(dense[:15], reference[0][:15], rtol=1e-5, atol=1e-5)  # <= 3 entries visible: all kept
    sinks = hf.model.layers[0].self_attn.sinks
    saved = sinks.detach().clone()
    try:
        with torch.no_grad():
            sinks.fill_(-1e4)
        assert rel_err(hf_models.hf_logits(hf, LONG).numpy(), reference[0]) > 1e-3
    finally:
        with torch.no_grad():
            sinks.copy_(saved)


def test_device_policy_and_sessions(dsv4, reference, tmp_path):
    """Parity and greedy tokens (decode from the incremental state: window keys, closed
    entries, the partial windows' raw rows, the indexer keys), then sessions: piecewise
    append equals the whole prompt (pieces that split windows of both rates), snapshot /
    resume (in memory and from disk) continues identically."""
    _, path = dsv4
    model = ftjax.load(path, policy="device")
    check_against(model, reference)
    hf_models.check_sessions(model, reference, LONG, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "host"])
def test_other_policies_match_transformers(dsv4, reference, policy, tmp_path):
    """host and lru: hash-routed experts are cached, fetched and host-computed like any other
    (the host part runs the clamped SwiGLU in the C++ expert kernel)."""
    _, path = dsv4
    model = ftjax.load(path, policy=policy, threads=2, **POLICIES[policy])
    check_against(model, reference)
    stats = model.stats()
    assert stats["host_computed"] > 0
    s = model.session()
    s.append(LONG)
    snap = s.snapshot()
    cont = s.generate(6, temperature=0.9, top_p=0.9, seed=3)
    for restored in (model.session(snap), model.session(Snapshot.load(snap.save(tmp_path / "s")))):
        assert restored.generate(6, temperature=0.9, top_p=0.9, seed=3) == cont


@pytest.mark.slow
def test_piecewise_append_in_many_splits(dsv4, reference):
    """Pieces of 1..7 tokens: windows of both rates close inside pieces, at their ends and
    across them; each piece's last logits equal the full forward's."""
    _, path = dsv4
    model = ftjax.load(path, policy="device")
    s = model.session()
    ends = [1, 2, 5, 9, 16, 17, 23, 24, 31, 36]
    tol = 2e-5 * np.abs(reference[0]).max()
    start = 0
    for end in ends:
        np.testing.assert_allclose(s.append(LONG[start:end]), reference[0][end - 1], atol=tol, rtol=0)
        start = end
    assert s.generate(8) == reference[1][:8]


@pytest.mark.slow
def test_batched_rows_and_the_state_cache(dsv4, reference):
    _, path = dsv4
    model = ftjax.load(path, policy="host")
    short = LONG[:9]  # rows at different positions decoded together: each row's own windows and buffers
    assert model.generate_many([LONG, short], 8) == [reference[1][:8], model.generate(short, 8)]
    # the partial windows' raw rows are fixed leaves (as a recurrent state): a prompt reuses
    # a stored snapshot (here the end of the first prompt), not any shared prefix
    cache = StateCache(model, "prefix")
    first = LONG[:25] + [5, 6]  # 27 tokens: the snapshot cuts a CSA window (of 4) and an HCA window (of 8)
    cache.prefill(first)
    second = first + [40, 41, 42]
    restored, reused = cache.prefill(second)
    assert reused == len(first)
    assert restored.generate(8) == model.generate(second, 8)
    _, reused = cache.prefill(LONG[:25] + [9, 9])  # diverges inside the snapshot: nothing to restore
    assert reused == 0


@pytest.mark.slow
def test_bf16_checkpoint(tmp_path):
    """Packed bf16 against transformers on the rounded weights, and against the float32
    layout; the tensors real checkpoints keep in float32 do not make it a float32 one."""
    hf = build(seed=8)
    path = hf_models.save(hf, tmp_path / "bf16", dtype=torch.bfloat16)
    ref = hf_models.bf16_rounded(hf)
    model = ftjax.load(path)
    assert model.checkpoint.pool.dtype == "bfloat16" and model.checkpoint.packed
    assert rel_err(model.logits(LONG), hf_models.hf_logits(ref, LONG).numpy()) <= 2e-4
    assert model.generate(LONG, 12) == hf_models.hf_greedy(ref, LONG, 12)
    unpacked = ftjax.load(path, dense_dtype="float32")
    assert rel_err(model.logits(LONG), unpacked.logits(LONG)) <= 1e-5


@pytest.mark.slow
def test_checkpoint_layouts(dsv4, reference, tmp_path):
    """transformers' own module names with fused experts (the raw state_dict), and the
    original release's names without the `model.` prefix (`embed.weight`, `layers.{i}.*`,
    `hc_head_fn`, `head.weight`) plus an `mtp.*` module, which is skipped."""
    hf, path = dsv4
    fused = ftjax.load(hf_models.save(hf, tmp_path / "fused", fused=True))
    assert rel_err(fused.logits(LONG), reference[0]) <= 2e-4
    sd = load_file(str(path / "model.safetensors"))
    sd = {k[len("model."):] if k.startswith("model.") else k: v for k, v in sd.items()}
    sd["embed.weight"] = sd.pop("embed_tokens.weight")
    for p in ("fn", "base", "scale"):
        sd[f"hc_head_{p}"] = sd.pop(f"hc_head.hc_{p}")
    sd["mtp.0.attn_norm.weight"] = torch.ones(CONFIG["hidden_size"])
    (tmp_path / "orig").mkdir()
    save_file(sd, str(tmp_path / "orig" / "model.safetensors"))
    (tmp_path / "orig" / "config.json").write_text((path / "config.json").read_text())
    assert rel_err(ftjax.load(tmp_path / "orig").logits(LONG), reference[0]) <= 2e-4


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    # sigmoid scores, every layer top-k routed, CSA first, 4 streams, YaRN on the compressed layers' RoPE
    dict(scoring_func="sigmoid", mlp_layer_types=["moe"] * 3, hc_mult=4,
         layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
         rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32,
                              beta_slow=1)),
    # a tight clamp (the SwiGLU limit acts on most pre-activations), o_groups 4, larger rates
    dict(swiglu_limit=0.5, o_groups=4, compress_rates={"compressed_sparse_attention": 8,
                                                       "heavily_compressed_attention": 16}, index_topk=2),
])
def test_other_geometries(overrides, tmp_path):
    hf = build(seed=9, **overrides)
    path = hf_models.save(hf, tmp_path)
    for policy in ("device", "host"):
        model = ftjax.load(path, policy=policy)
        assert rel_err(model.logits(LONG), hf_models.hf_logits(hf, LONG).numpy()) <= 2e-4
        assert model.generate(LONG, 10) == hf_models.hf_greedy(hf, LONG, 10)


# ---- routing against numpy -----------------------------------------------------------------

def test_routing_functions():
    rng = np.random.RandomState(0)
    logits, bias = rng.randn(5, 8).astype(np.float32), (0.1 * rng.randn(8)).astype(np.float32)
    scores = np.sqrt(np.log1p(np.exp(logits)))
    np.testing.assert_allclose(np.asarray(route_scores(logits, "sqrtsoftplus")), scores, rtol=1e-6)
    ids, w = route_top_k(scores, bias, 3, 1.5)
    want = np.argsort(-(scores + bias), axis=1)[:, :3]
    assert (np.sort(np.asarray(ids), 1) == np.sort(want, 1)).all()
    picked = np.take_along_axis(scores, np.asarray(ids), 1)
    np.testing.assert_allclose(np.asarray(w), picked / picked.sum(1, keepdims=True) * 1.5, rtol=1e-6)
    table = rng.randint(0, 8, size=(10, 3)).astype(np.float32)
    tokens = np.array([3, 0, 9, 3, 1])
    ids, w = route_hash(scores, table, tokens, 2.0)
    assert (np.asarray(ids) == table[tokens]).all() and np.asarray(ids).dtype == np.int32
    picked = np.take_along_axis(scores, table[tokens].astype(int), 1)
    np.testing.assert_allclose(np.asarray(w), picked / picked.sum(1, keepdims=True) * 2.0, rtol=1e-6)


# ---- state ----------------------------------------------------------------------------------

def test_state_leaves(dsv4):
    _, path = dsv4
    model = ftjax.load(path, policy="device")
    state = model.new_state(1, 32)
    assert set(state[0]) == {"kv"}
    assert set(state[1]) == {"kv", "comp", "buf_kv", "buf_gate", "idx_comp", "idx_buf_kv", "idx_buf_gate"}
    assert set(state[2]) == {"kv", "comp", "buf_kv", "buf_gate"}
    assert state[1]["buf_kv"].shape == (1, 8, 32)  # 2 windows of 4 raw rows, two series of 16
    assert state[2]["buf_kv"].shape == (1, 8, 16)  # 1 window of 8 rows
    assert state[1]["idx_comp"].shape == (1, 8, 8)  # one row per entry: 32 / 4


@pytest.mark.parametrize("max_len", [1, 13, 32, 1000, 1 << 20])
def test_state_size_does_not_grow_with_the_window(max_len):
    """The window's keys are a ring of W rows whatever the capacity; the compressed
    entries (and the indexer's keys) take ceil(max_len / rate) rows; nothing else
    depends on the capacity. resize_state gives the same shapes as a fresh state, keeps
    the ring and the buffers as they are and the entries that fit."""
    import jax

    from ftjax.models.common import init_state, resize_state
    cfg = config_from_hf(_hf_dict())
    W, m_csa, m_hca = 6, 4, 8
    shapes = [{k: a.shape for k, a in layer.items()} for layer in jax.eval_shape(lambda: init_state(cfg, 2, max_len))]
    entries = lambda m: -(-max_len // m)
    assert shapes[0] == {"kv": (2, W, 16)}
    assert shapes[1] == {"kv": (2, W, 16), "comp": (2, entries(m_csa), 16), "buf_kv": (2, 8, 32),
                         "buf_gate": (2, 8, 32), "idx_comp": (2, entries(m_csa), 8), "idx_buf_kv": (2, 8, 16),
                         "idx_buf_gate": (2, 8, 16)}
    assert shapes[2] == {"kv": (2, W, 16), "comp": (2, entries(m_hca), 16), "buf_kv": (2, 8, 16),
                         "buf_gate": (2, 8, 16)}
    if max_len > 1000:
        return
    rng = np.random.RandomState(max_len)
    state = jax.tree.map(lambda a: rng.randn(*a.shape).astype(np.float32), init_state(cfg, 2, 24))
    resized = resize_state(cfg, state, max_len)
    assert [{k: a.shape for k, a in layer.items()} for layer in resized] == shapes
    for before, after, m in zip(state, resized, (None, m_csa, m_hca)):
        for name, a in after.items():
            if name.endswith("comp"):
                n = min(a.shape[1], before[name].shape[1])
                np.testing.assert_array_equal(np.asarray(a[:, :n]), before[name][:, :n])
                assert not np.asarray(a[:, n:]).any()
            else:
                np.testing.assert_array_equal(np.asarray(a), before[name])


def test_decode_far_past_the_window(dsv4):
    """Decode from position 2 for 40 steps: the ring fills, then wraps six times, ten CSA
    and four HCA windows close during decode; every step's logits equal transformers'
    full forward over the same tokens (and ftjax's own)."""
    hf, path = dsv4
    model = ftjax.load(path, policy="device")
    prompt, steps = LONG[:2], []
    new = list(model.generate_stream(prompt, 40, step_logits=steps))
    assert len(steps) == 40
    ids = prompt + new[:-1]
    assert rel_err(np.stack(steps), hf_models.hf_logits(hf, ids).numpy()[1:]) <= 2e-4
    assert rel_err(np.stack(steps), model.logits(ids)[1:]) <= 2e-4


def test_inactive_rows_keep_their_state(dsv4, reference):
    """A batch row without valid tokens (a finished or padding row) leaves every leaf of
    its state as it was, in decode (one token) and in a chunk, while the other row moves
    on (its ring, entries and buffers change)."""
    import jax
    import jax.numpy as jnp

    _, path = dsv4
    model = ftjax.load(path, policy="device")
    m = model

    def run(state, tokens, start, length):
        logits, state = m.prefill_step(state, np.asarray(tokens, np.int32), np.asarray(start, np.int32),
                                       np.asarray(length, np.int32))
        return np.asarray(logits), state

    tokens = np.zeros((2, 16), np.int32)
    tokens[0, :13], tokens[1, :10] = LONG[:13], LONG[20:30]
    logits, state = run(m.new_state(2, 64), tokens, [0, 0], [13, 10])
    tol = 2e-5 * np.abs(reference[0]).max()
    np.testing.assert_allclose(logits[0], reference[0][12], atol=tol, rtol=0)
    for T, length in ((1, [1, 0]), (16, [11, 0]), (1, [0, 1])):
        before = jax.device_get(state)
        chunk = np.zeros((2, T), np.int32)
        chunk[:, :max(length)] = LONG[13:13 + max(length)]
        _, state = run(state, chunk, [13, 10] if T == 1 else [14, 10], length)
        after = jax.device_get(state)
        idle, busy = (1, 0) if length[0] else (0, 1)
        for layer_before, layer_after in zip(before, after):
            for name in layer_before:
                np.testing.assert_array_equal(layer_after[name][idle], layer_before[name][idle], err_msg=name)
        assert not np.array_equal(after[0]["kv"][busy], before[0]["kv"][busy])
        assert not np.array_equal(after[1]["buf_kv"][busy], before[1]["buf_kv"][busy])
        if T > 1:  # positions 14..24 close CSA windows (15, 19, 23) and HCA ones (15, 23)
            for layer in (1, 2):
                assert not np.array_equal(after[layer]["comp"][busy], before[layer]["comp"][busy])


def test_refused_runtime_options(dsv4):
    """No streamed prefill (a layer's program cannot carry the streams or the token ids);
    the host expert kernel is given the experts' clamp."""
    _, path = dsv4
    with pytest.raises(ValueError, match="streamed"):
        ftjax.load(path, policy="host", prefill="streamed")
    model = ftjax.load(path, policy="host")
    assert model._streamed is None and model._host.swiglu_limit == model.config.dsv4.swiglu_limit is not None


# ---- configs ---------------------------------------------------------------------------------

def _hf_dict(**overrides) -> dict:
    return copy.deepcopy(AutoConfig.for_model(FAMILY, **{**CONFIG, **overrides}).to_dict())


def test_config_fields():
    cfg = config_from_hf(_hf_dict())
    assert cfg.layer_kinds == ("dsv4_sliding", "dsv4_csa", "dsv4_hca") and all(cfg.moe_layers)
    v = cfg.dsv4
    assert v.hash_layers == (True, False, False) and v.scoring_func == "sqrtsoftplus" and v.swiglu_limit == 10.0
    assert (v.csa_rate, v.hca_rate, v.rope_dim, v.hc_mult, v.o_groups) == (4, 8, 4, 3, 2)
    assert v.compress_rope_theta == 160000.0 and v.compress_rope_scaling is None and cfg.rope_theta == 10000.0
    assert cfg.shared_expert_d_ff == cfg.d_ff_expert == 16 and cfg.router == "deepseek_v4"
    real = config_from_hf(AutoConfig.for_model(FAMILY).to_dict())  # transformers' defaults: DeepSeek-V4-Flash's sizes
    assert (real.d_model, real.num_layers, real.num_heads, real.head_dim, real.num_experts) == (4096, 43, 64, 512, 256)
    assert real.dsv4.hash_layers[:4] == (True, True, True, False) and real.dsv4.rope_dim == 64
    legacy = {**_hf_dict(), "compress_ratios": [4, 128, 0]}
    legacy.pop("layer_types")
    assert config_from_hf(legacy).layer_kinds == ("dsv4_csa", "dsv4_hca", "dsv4_sliding")
    yarn = config_from_hf(_hf_dict(rope_parameters=dict(rope_type="yarn", factor=16.0,
                                                        original_max_position_embeddings=64)))
    assert yarn.dsv4.compress_rope_scaling.factor == 16.0 and yarn.dsv4.compress_rope_scaling.attention_factor == 1.0


@pytest.mark.parametrize("change,named", [
    (dict(scoring_func="softmax"), "'softmax'"),
    (dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"]), "full_attention"),
    (dict(mlp_layer_types=["hash_moe", "dense", "moe"]), "mlp_layer_types"),
    (dict(n_shared_experts=2), "n_shared_experts"),
    (dict(quantization_config={"quant_method": "fp8"}), "'fp8'"),
    (dict(hidden_act="gelu"), "'gelu'"),
    (dict(o_groups=3), "o_groups"),
    (dict(compress_ratios=[4, 64, 0]), "64"),
])
def test_unsupported_configs_raise(change, named):
    hf = {**_hf_dict(), **change}
    if "compress_ratios" in change:
        hf.pop("layer_types")
    with pytest.raises(ConfigError, match=named):
        config_from_hf(hf)
