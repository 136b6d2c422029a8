"""ftjax against transformers on tiny random checkpoints of every family: full-forward
logits, 20-token greedy continuations, and decode-step logits vs full-forward logits."""

import jax
import numpy as np
import pytest
import torch

import ftjax
import hf_models

PROMPT = [int(t) for t in np.random.RandomState(0).randint(0, 96, size=20)]


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def check_model(hf, path, tol=1e-4, greedy=True, prompt=PROMPT, **load_kw):
    """Logits (and greedy tokens) against transformers under numerics="exact" (f32 K/V):
    the parity suite's numerics whatever the checkpoint's dtype."""
    model = ftjax.load(path, **{"numerics": "exact", **load_kw})
    assert rel_err(model.logits(prompt), hf_models.hf_logits(hf, prompt).numpy()) <= tol
    if greedy:
        steps = []
        new = list(model.generate_stream(prompt, 20, step_logits=steps))
        assert new == hf_models.hf_greedy(hf, prompt, 20)
        # the logits each decode step sampled from equal the full forward's at that position
        full = model.logits(prompt + new[:-1])
        assert rel_err(np.stack(steps), full[len(prompt) - 1:]) <= tol
    return model


@pytest.mark.parametrize("family", sorted(hf_models.FAMILY_CONFIGS))
def test_family_matches_transformers(family, tmp_path):
    hf = hf_models.build(family)
    check_model(hf, hf_models.save(hf, tmp_path))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_moe_text"])
def test_fused_expert_layout(family, tmp_path):
    hf = hf_models.build(family, seed=1)
    check_model(hf, hf_models.save(hf, tmp_path, fused=True), greedy=False)


def test_sharded_checkpoint(tmp_path):
    hf = hf_models.build("qwen2_moe", seed=2)
    path = hf_models.save(hf, tmp_path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 2
    check_model(hf, path, greedy=False)


def test_bf16_checkpoint(tmp_path):
    hf = hf_models.build("qwen3_moe", seed=3)
    path = hf_models.save(hf, tmp_path, dtype=torch.bfloat16)
    model = check_model(hf_models.bf16_rounded(hf), path, greedy=False)
    assert model.checkpoint.pool.dtype == "bfloat16"


@pytest.mark.parametrize("family,overrides", [
    ("qwen3_moe", dict(num_experts=7, num_experts_per_tok=1, tie_word_embeddings=True, mlp_only_layers=[],
                       decoder_sparse_step=2, num_hidden_layers=4)),
    ("mixtral", dict(sliding_window=6, num_local_experts=3, num_key_value_heads=4)),
    ("qwen2_moe", dict(num_experts=9, num_experts_per_tok=3, norm_topk_prob=True, hidden_size=48,
                       num_attention_heads=6, num_key_value_heads=3)),
    ("olmoe", dict(num_experts=5, num_experts_per_tok=1, clip_qkv=None, norm_topk_prob=True)),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=5, max_window_layers=2, num_hidden_layers=4,
                       mlp_only_layers=[3], shared_expert_intermediate_size=0)),
    ("qwen3_moe", dict(mlp_only_layers=[0, 1, 2])),  # no MoE layer at all: an empty expert pool
    # hybrids: tied head, other layer patterns, half-rotary heads, one value head per key head, K = 3
    ("qwen3_next", dict(tie_word_embeddings=True, partial_rotary_factor=0.5, linear_num_value_heads=2,
                        layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"])),
    ("qwen3_5_moe_text", dict(tie_word_embeddings=True, linear_conv_kernel_dim=3, num_key_value_heads=4,
                              linear_key_head_dim=4, linear_value_head_dim=8, partial_rotary_factor=1.0)),
    # GLM: no q/k norm or biases, one expert group, unnormalised weights, every layer MoE, two shared
    # experts, tied head, YaRN over full-width rotary
    ("glm4_moe", dict(use_qk_norm=False, attention_bias=False, n_group=1, topk_group=1, norm_topk_prob=False,
                      first_k_dense_replace=0, n_shared_experts=2, tie_word_embeddings=True,
                      rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                                           rope_theta=10000.0, partial_rotary_factor=1.0))),
])
def test_other_geometries(family, overrides, tmp_path):
    hf = hf_models.build(family, seed=4, **overrides)
    check_model(hf, hf_models.save(hf, tmp_path))


def _param_dtypes(model) -> set:
    return {str(a.dtype) for a in jax.tree.leaves(model._params)}


@pytest.mark.parametrize("family,overrides", [
    *[(f, {}) for f in sorted(hf_models.FAMILY_CONFIGS)],
    ("qwen3_moe", dict(tie_word_embeddings=True, mlp_only_layers=[1])),  # tied head, a dense layer
])
def test_packed_bf16_dense_weights(family, overrides, tmp_path):
    """A bf16 checkpoint keeps its matrices as bf16 bits [out, in] (host GEMV kernel on
    CPU): same logits and greedy tokens as transformers on the same rounded weights,
    and as the float32 [in, out] layout."""
    hf = hf_models.build(family, seed=5, **overrides)
    path = hf_models.save(hf, tmp_path, dtype=torch.bfloat16)
    model = check_model(hf_models.bf16_rounded(hf), path)
    assert model.checkpoint.packed and "uint16" in _param_dtypes(model)
    unpacked = ftjax.load(path, dense_dtype="float32", numerics="exact")
    assert not unpacked.checkpoint.packed and "uint16" not in _param_dtypes(unpacked)
    assert rel_err(model.logits(PROMPT), unpacked.logits(PROMPT)) <= 1e-5


def test_dense_dtype_never_rounds_silently(tmp_path):
    hf = hf_models.build("qwen3_moe", seed=6)
    path = hf_models.save(hf, tmp_path)  # float32 tensors
    model = ftjax.load(path, dense_dtype="bfloat16")
    assert not model.checkpoint.packed  # kept f32: bf16 would drop bits
    with pytest.raises(ValueError, match="dense_dtype"):
        ftjax.load(path, dense_dtype="float16")
