"""Helpers the family files share to read HF configs: the fields every decoder has, the
per-layer MoE / sliding-window patterns, the hybrids' fields, and the DeepSeek-style MoE
fields (first_k_dense_replace, shared experts, sigmoid group routing) of glm4_moe and
deepseek_v3."""

from __future__ import annotations

import re
from typing import Any

from ftjax.config import (ConfigError, DeltaNetConfig, ModelConfig, eos_ids, hf_get, rope_params, rope_theta,
                          validate)


def sparse_layers(hf: dict[str, Any], num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """Qwen-style MoE placement: `mlp_only_layers` are dense, else every
    `decoder_sparse_step`-th layer is MoE."""
    dense = set(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step") or 1)
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def sliding_windows(hf: dict[str, Any], num_layers: int, enabled: bool) -> tuple[int, ...]:
    """Per-layer window (0 = full). `layer_types` wins when a config has it."""
    window = int(hf.get("sliding_window") or 0)
    if not enabled or window <= 0:
        return (0,) * num_layers
    types = hf.get("layer_types")
    if types is None:
        return (window,) * num_layers
    if len(types) != num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def base_fields(hf: dict[str, Any], yarn: bool = False) -> dict[str, Any]:
    """Fields read the same way for every family. yarn: the family implements YaRN rope
    scaling (`config.rope_params`); else only the default RoPE is accepted."""
    d_model = int(hf_get(hf, "d_model"))
    num_heads = int(hf_get(hf, "num_heads"))
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"hidden_act {act!r} is not supported (only silu / SwiGLU experts)")
    return dict(
        model_type=hf["model_type"],
        vocab_size=int(hf["vocab_size"]),
        d_model=d_model,
        num_layers=int(hf_get(hf, "num_layers")),
        num_heads=num_heads,
        num_kv_heads=int(hf_get(hf, "num_kv_heads", num_heads)),
        head_dim=int(hf.get("head_dim") or d_model // num_heads),
        num_experts=int(hf_get(hf, "num_experts")),
        top_k=int(hf_get(hf, "top_k")),
        **(dict(zip(("rope_theta", "rope_scaling"), rope_params(hf))) if yarn else dict(rope_theta=rope_theta(hf))),
        rms_norm_eps=float(hf_get(hf, "rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf_get(hf, "tie_embeddings", False)),
        max_position=int(hf_get(hf, "max_position", 4096)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf),
    )


def check(cfg: ModelConfig) -> ModelConfig:
    """Sanity checks that catch corrupt configs before any tensor is read."""
    if cfg.num_kv_heads > 0 and cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(f"num_attention_heads {cfg.num_heads} is not a multiple of num_key_value_heads {cfg.num_kv_heads}")
    if not 0 < cfg.top_k <= cfg.num_experts:
        raise ConfigError(f"num_experts_per_tok {cfg.top_k} must be in 1..num_experts ({cfg.num_experts}: "
                          f"num_experts / num_local_experts / n_routed_experts)")
    if cfg.head_dim % 2:
        raise ConfigError(f"head_dim {cfg.head_dim} must be even for RoPE")
    for name, hf_names in (("vocab_size", "vocab_size"), ("d_model", "hidden_size"),
                           ("num_layers", "num_hidden_layers"), ("d_ff_expert", "moe_intermediate_size / intermediate_size")):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} ({hf_names}) must be positive, got {getattr(cfg, name)}")
    return validate(cfg)


HYBRID_KINDS = {"linear_attention": "gated_deltanet", "full_attention": "gated_attention"}


def hybrid_fields(hf: dict[str, Any], num_layers: int, head_dim: int, fused_qkvz: bool) -> dict[str, Any]:
    """The fields of Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5/3.6): per-layer kinds from
    `layer_types` (or every `full_attention_interval`-th layer full), zero-centred norms,
    partial rotary, and the linear-attention sizes."""
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"layer_types must list {num_layers} layer types, got {types!r}")
    unknown = sorted({str(t) for t in types} - set(HYBRID_KINDS))
    if unknown:
        raise ConfigError(f"layer_types {unknown} are not supported (known: {', '.join(HYBRID_KINDS)})")
    params = hf.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    if not 0.0 < factor <= 1.0:
        raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {factor}")
    return dict(
        layer_kinds=tuple(HYBRID_KINDS[t] for t in types),
        norm_offset=1.0,
        rotary_dim=int(head_dim * factor),
        deltanet=DeltaNetConfig(
            num_k_heads=int(hf["linear_num_key_heads"]),
            num_v_heads=int(hf["linear_num_value_heads"]),
            k_head_dim=int(hf["linear_key_head_dim"]),
            v_head_dim=int(hf["linear_value_head_dim"]),
            conv_kernel=int(hf.get("linear_conv_kernel_dim") or 4),
            fused_qkvz=fused_qkvz,
        ),
    )


def hybrid_config(hf: dict[str, Any], fused_qkvz: bool) -> ModelConfig:
    """ModelConfig of a Qwen3-Next / Qwen3.5-MoE text model: gated attention every few
    layers, Gated DeltaNet elsewhere, routed experts plus a sigmoid-gated shared expert."""
    f = base_fields(hf)
    bias = bool(hf.get("attention_bias", False))
    return check(ModelConfig(
        **f,
        d_ff=int(hf.get("intermediate_size") or 0),
        d_ff_expert=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        moe_layers=sparse_layers(hf, f["num_layers"], f["num_experts"]),
        sliding_windows=(0,) * f["num_layers"],
        qk_norm="head",
        qkv_bias=bias,
        o_bias=bias,
        shared_expert_d_ff=int(hf.get("shared_expert_intermediate_size") or 0),
        shared_expert_gate=True,
        **hybrid_fields(hf, f["num_layers"], f["head_dim"], fused_qkvz),
    ))


# DeepSeek-style MoE: the values transformers' DeepseekV3TopkRouter / Glm4MoeTopkRouter implement.
TOPK_METHODS = (None, "noaux_tc")
SCORING_FUNCS = (None, "sigmoid")


def deepseek_moe_fields(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """MoE fields of glm4_moe / deepseek_v3: the first `first_k_dense_replace` layers dense
    (intermediate_size), then MoE layers of `n_routed_experts` routed experts plus
    `n_shared_experts` ungated shared experts (one MLP of n_shared x moe_intermediate_size),
    routed by `sigmoid_group`. Values transformers does not implement either (another
    `topk_method` or `scoring_func`, `moe_layer_freq` != 1, a quantized checkpoint) are a
    ConfigError naming the value."""
    if hf.get("topk_method") not in TOPK_METHODS:
        raise ConfigError(f"topk_method {hf['topk_method']!r} is not supported (only 'noaux_tc')")
    if hf.get("scoring_func") not in SCORING_FUNCS:
        raise ConfigError(f"scoring_func {hf['scoring_func']!r} is not supported (only 'sigmoid')")
    if int(hf.get("moe_layer_freq") or 1) != 1:
        raise ConfigError(f"moe_layer_freq {hf['moe_layer_freq']!r} is not supported (only 1: every layer "
                          "from first_k_dense_replace on is MoE)")
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ConfigError(f"quantization_config {method!r} is not supported (use a bf16 / fp32 checkpoint)")
    dense = int(hf.get("first_k_dense_replace") or 0)
    d_ff_expert = int(hf["moe_intermediate_size"])
    return dict(
        d_ff=int(hf.get("intermediate_size") or 0),
        d_ff_expert=d_ff_expert,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        moe_layers=tuple(i >= dense for i in range(num_layers)),
        sliding_windows=(0,) * num_layers,
        shared_expert_d_ff=int(hf.get("n_shared_experts") or 0) * d_ff_expert,
        shared_expert_gate=False,
        router="sigmoid_group",
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
    )


def mtp_ignored_keys(hf: dict[str, Any]) -> list[tuple[re.Pattern, str]]:
    """The multi-token-prediction layers GLM-4.5 / DeepSeek-V3 checkpoints store as
    model.layers.{L .. L + num_nextn_predict_layers - 1}: not part of the decoder."""
    n, L = int(hf.get("num_nextn_predict_layers") or 0), int(hf_get(hf, "num_layers"))
    if n <= 0:
        return []
    layers = "|".join(str(L + i) for i in range(n))
    return [(re.compile(rf"model\.layers\.({layers})\..*"),
             "the multi-token-prediction layers (speculative decoding) are not used")]
