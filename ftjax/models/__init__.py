"""Model families: each file translates one Hugging Face architecture into the shared
decoder of `common.py` (a `ModelConfig` plus tensor-name aliases). Add a family by
writing a file with `config_from_hf` and `KEY_ALIASES` and registering it here. A family
whose decoder differs (DeepSeek-V4) registers its own `CausalLM` subclass in
`common.MODEL_CLASSES`, and may give `KEPT_F32` / `IGNORED_KEYS` (checkpoint reading),
`executor_options` (how its experts run: e.g. a SwiGLU clamp) and `streamed_prefill(cfg)`
(False where a layer's program cannot run alone)."""

from __future__ import annotations

from types import ModuleType

from ftjax.config import ConfigError, ModelConfig, check_hf_values
from ftjax.models import deltanet  # noqa: F401  (registers the gated_deltanet layer kind)
from ftjax.models import mla  # noqa: F401  (registers the mla layer kind)
from ftjax.models import dsa  # noqa: F401  (registers the mla_dsa layer kind)
from ftjax.models import dsv4_attention  # noqa: F401  (registers the dsv4_* layer kinds)
from ftjax.models import deepseek_v3, deepseek_v4, glm4_moe, glm_moe_dsa, mixtral, olmoe, qwen2_moe, qwen3_5_moe, qwen3_moe, qwen3_next

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
    "deepseek_v4": deepseek_v4,  # its own decoder (hyper-connections, hash routing): common.MODEL_CLASSES
}


def family(model_type: str | None) -> ModuleType:
    if model_type not in FAMILIES:
        raise ConfigError(
            f"unknown model_type {model_type!r}: ftjax supports {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig from a parsed config.json (dispatches on `model_type`); every known
    value is checked first (`config.check_hf_values`)."""
    fam = family(hf.get("model_type"))
    check_hf_values(hf)
    return fam.config_from_hf(hf)
