"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): qkv bias, a shared expert scaled by a
sigmoid gate, optional dense layers, sliding windows via `layer_types`."""

from ftjax.config import ModelConfig
from ftjax.models.hf import base_fields, check, sliding_windows, sparse_layers

KEY_ALIASES: list[tuple[str, str]] = []


def config_from_hf(hf: dict) -> ModelConfig:
    f = base_fields(hf)
    return check(ModelConfig(
        **f,
        d_ff=int(hf.get("intermediate_size") or 0),
        d_ff_expert=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=sparse_layers(hf, f["num_layers"], f["num_experts"]),
        sliding_windows=sliding_windows(hf, f["num_layers"], bool(hf.get("use_sliding_window", False))),
        qkv_bias=bool(hf.get("qkv_bias", True)),
        shared_expert_d_ff=int(hf.get("shared_expert_intermediate_size") or 0),
        shared_expert_gate=True,
    ))
