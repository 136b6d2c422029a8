"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): per-head q/k RMSNorm, optional dense
layers (`mlp_only_layers`, `decoder_sparse_step`), `norm_topk_prob`, no shared expert."""

from ftjax.config import ModelConfig
from ftjax.models.hf import base_fields, check, sliding_windows, sparse_layers

KEY_ALIASES: list[tuple[str, str]] = []


def config_from_hf(hf: dict) -> ModelConfig:
    f = base_fields(hf)
    bias = bool(hf.get("attention_bias", False))
    return check(ModelConfig(
        **f,
        d_ff=int(hf.get("intermediate_size") or 0),
        d_ff_expert=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=sparse_layers(hf, f["num_layers"], f["num_experts"]),
        sliding_windows=sliding_windows(hf, f["num_layers"], bool(hf.get("use_sliding_window", False))),
        qk_norm="head",
        qkv_bias=bias,
        o_bias=bias,
    ))
