"""Model families: each file translates one Hugging Face architecture into the shared
decoder of `common.py` (a `ModelConfig` plus tensor-name aliases). Add a family by
writing a file with `config_from_hf` and `KEY_ALIASES` and registering it here."""

from __future__ import annotations

from types import ModuleType

from ftjax.config import ConfigError, ModelConfig
from ftjax.models import mixtral, olmoe, qwen2_moe, qwen3_moe

FAMILIES: dict[str, ModuleType] = {
    "qwen3_moe": qwen3_moe,
    "qwen2_moe": qwen2_moe,
    "mixtral": mixtral,
    "olmoe": olmoe,
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
