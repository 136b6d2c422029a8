"""Qwen3-Next (Qwen3-Next-80B-A3B): a hybrid of Gated DeltaNet linear attention (three
layers in four) and gated full attention, every layer with routed experts plus a
sigmoid-gated shared expert; zero-centred RMSNorms, partial rotary (a quarter of each
head), per-head q/k norms. The DeltaNet input projections are stored fused
(`in_proj_qkvz`, `in_proj_ba`, grouped per key head). See `ftjax.models.deltanet`."""

import re

from ftjax.config import ModelConfig
from ftjax.models.hf import hybrid_config

KEY_ALIASES: list[tuple[str, str]] = []

# Checkpoint tensors ftjax does not use, and why.
IGNORED_KEYS: list[tuple[re.Pattern, str]] = [
    (re.compile(r"mtp\..*"), "the multi-token-prediction head (speculative decoding) is not used"),
]


def config_from_hf(hf: dict) -> ModelConfig:
    return hybrid_config(hf, fused_qkvz=True)
