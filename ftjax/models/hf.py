"""Helpers the family files share to read HF configs: the fields every decoder has, and
the per-layer MoE / sliding-window patterns."""

from __future__ import annotations

from typing import Any

from ftjax.config import ConfigError, DeltaNetConfig, ModelConfig, eos_ids, hf_get, rope_theta, validate


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


def base_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Fields read the same way for every family."""
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
        rope_theta=rope_theta(hf),
        rms_norm_eps=float(hf_get(hf, "rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf_get(hf, "tie_embeddings", False)),
        max_position=int(hf_get(hf, "max_position", 4096)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf),
    )


def check(cfg: ModelConfig) -> ModelConfig:
    """Sanity checks that catch corrupt configs before any tensor is read."""
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(f"num_attention_heads {cfg.num_heads} is not a multiple of num_key_value_heads {cfg.num_kv_heads}")
    if not 0 < cfg.top_k <= cfg.num_experts:
        raise ConfigError(f"num_experts_per_tok {cfg.top_k} must be in 1..num_experts ({cfg.num_experts})")
    if cfg.head_dim % 2:
        raise ConfigError(f"head_dim {cfg.head_dim} must be even for RoPE")
    for name in ("vocab_size", "d_model", "num_layers", "d_ff_expert"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(cfg, name)}")
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
