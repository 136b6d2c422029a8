"""Mixtral (8x7B, 8x22B): every layer MoE, experts sized by `intermediate_size`, top-k
weights always renormalised, optional sliding window on every layer. Checkpoints name
the block `block_sparse_moe` and the expert matrices w1 (gate), w3 (up), w2 (down)."""

from ftjax.config import ModelConfig, hf_get
from ftjax.models.hf import base_fields, check, sliding_windows

KEY_ALIASES = [
    (r"\.block_sparse_moe\.", ".mlp."),
    (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
    (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
    (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
]


def config_from_hf(hf: dict) -> ModelConfig:
    f = base_fields(hf)
    return check(ModelConfig(
        **f,
        d_ff=0,
        d_ff_expert=int(hf_get(hf, "intermediate_size")),
        norm_topk_prob=True,
        moe_layers=(True,) * f["num_layers"],
        sliding_windows=sliding_windows(hf, f["num_layers"], True),
    ))
