"""Qwen3.5-MoE / Qwen3.6-MoE (Qwen3.6-35B-A3B, the paper's headline model): the Qwen3-Next
design (Gated DeltaNet hybrid, gated attention, shared expert) with the DeltaNet input
projections stored split (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`).

Two layouts load:
- `qwen3_5_moe_text` (Qwen3_5MoeForCausalLM): the text model at the top level;
- `qwen3_5_moe` (Qwen3_5MoeForConditionalGeneration, the released checkpoints): the text
  config under `text_config`, its tensors under `model.language_model.`; the vision
  tower (`model.visual.`) is skipped — ftjax runs text only, images are not supported.
Text positions make the multimodal RoPE (mrope) the ordinary one: all three position
axes are equal, so its sections carry identical frequencies."""

import re

from ftjax.config import ConfigError, ModelConfig
from ftjax.models.hf import hybrid_config

KEY_ALIASES: list[tuple[str, str]] = [(r"^model\.language_model\.", "model.")]

IGNORED_KEYS: list[tuple[re.Pattern, str]] = [
    (re.compile(r"model\.visual\..*"), "the vision tower: ftjax runs the text model, images are not supported"),
    (re.compile(r"mtp\..*"), "the multi-token-prediction head (speculative decoding) is not used"),
]


def text_config(hf: dict) -> dict:
    """The text model's config: `text_config` of a multimodal config.json (with the
    top-level tie_word_embeddings, which governs the LM head there), else hf itself."""
    if "text_config" not in hf:
        return hf
    text = hf["text_config"]
    if not isinstance(text, dict):
        raise ConfigError(f"text_config must be a JSON object, got {type(text).__name__}")
    merged = {**text, "model_type": hf["model_type"]}
    if "tie_word_embeddings" in hf:
        merged["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return merged


def config_from_hf(hf: dict) -> ModelConfig:
    return hybrid_config(text_config(hf), fused_qkvz=False)
