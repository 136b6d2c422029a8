"""OLMoE (OLMoE-1B-7B): q/k RMSNorm over the full projection width (not per head),
optional `clip_qkv`, every layer MoE, experts sized by `intermediate_size`."""

from ftjax.config import ModelConfig, hf_get
from ftjax.models.hf import base_fields, check, sliding_windows

KEY_ALIASES: list[tuple[str, str]] = []


def config_from_hf(hf: dict) -> ModelConfig:
    f = base_fields(hf)
    bias = bool(hf.get("attention_bias", False))
    clip = hf.get("clip_qkv")
    return check(ModelConfig(
        **f,
        d_ff=0,
        d_ff_expert=int(hf_get(hf, "intermediate_size")),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=(True,) * f["num_layers"],
        sliding_windows=sliding_windows(hf, f["num_layers"], False),
        qk_norm="full",
        qkv_bias=bias,
        o_bias=bias,
        clip_qkv=float(clip) if clip is not None else None,
    ))
