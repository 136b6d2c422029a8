"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): GQA attention with partial rotary (half of
each head by default), qkv biases (`attention_bias`; o_proj has none), optional per-head
q/k RMSNorm (`use_qk_norm`); the first `first_k_dense_replace` layers dense, the rest
routed experts plus ungated shared experts, routed DeepSeek-style (`sigmoid_group`:
sigmoid scores, e_score_correction_bias, group-limited top-k, routed_scaling_factor).

Checkpoints name the shared experts `mlp.shared_experts.*` (aliased to the canonical
`mlp.shared_expert.*` of Qwen2-MoE) and store the multi-token-prediction layer after the
last decoder layer (`model.layers.{L}`, skipped). RoPE: default or YaRN.
"""

from ftjax.config import ConfigError, ModelConfig
from ftjax.models.hf import base_fields, check, deepseek_moe_fields, mtp_ignored_keys

KEY_ALIASES = [(r"\.mlp\.shared_experts\.", ".mlp.shared_expert.")]

ignored_keys = mtp_ignored_keys


def config_from_hf(hf: dict) -> ModelConfig:
    f = base_fields(hf, yarn=True)
    params = hf.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))
    if not 0.0 < factor <= 1.0:
        raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {factor}")
    bias = bool(hf.get("attention_bias", False))
    return check(ModelConfig(
        **f,
        **deepseek_moe_fields(hf, f["num_layers"]),
        qk_norm="head" if hf.get("use_qk_norm", False) else "none",
        qkv_bias=bias,
        rotary_dim=int(f["head_dim"] * factor),
    ))
