"""Model families: each file translates one Hugging Face architecture into the shared
decoder of `common.py` (a `ModelConfig` plus tensor-name aliases). Add a family by
writing a file with `config_from_hf` and `KEY_ALIASES` and registering it here."""

from __future__ import annotations

from types import ModuleType

from ftjax.config import ConfigError, ModelConfig
from ftjax.models import deltanet  # noqa: F401  (registers the gated_deltanet layer kind)
from ftjax.models import mla  # noqa: F401  (registers the mla layer kind)
from ftjax.models import dsa  # noqa: F401  (registers the mla_dsa layer kind)
from ftjax.models import deepseek_v3, glm4_moe, glm_moe_dsa, mixtral, olmoe, qwen2_moe, qwen3_5_moe, qwen3_moe, qwen3_next

FAMILIES: dict[str, ModuleType] = {
    "qwen3_moe": qwen3_moe,
    "qwen2_moe": qwen2_moe,
    "mixtral": mixtral,
    "olmoe": olmoe,
    "qwen3_next": qwen3_next,
    "qwen3_5_moe": qwen3_5_moe,  # the multimodal checkpoint: its text model is loaded
    "qwen3_5_moe_text": qwen3_5_moe,
    "glm4_moe": glm4_moe,
    "deepseek_v3": deepseek_v3,
    "glm_moe_dsa": glm_moe_dsa,
}


def family(model_type: str | None) -> ModuleType:
    if model_type not in FAMILIES:
        raise ConfigError(
            f"unknown model_type {model_type!r}: ftjax supports {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig from a parsed config.json (dispatches on `model_type`)."""
    return family(hf.get("model_type")).config_from_hf(hf)
