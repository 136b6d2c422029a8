"""Helpers the family files share to read HF configs: the fields every decoder has, and
the per-layer MoE / sliding-window patterns."""

from __future__ import annotations

from typing import Any

from ftjax.config import ConfigError, ModelConfig, eos_ids, hf_get, rope_theta, validate


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
