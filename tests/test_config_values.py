"""Every config.json value a family reads is checked before any reader runs
(`ftjax.config.HF_VALUE_RULES`): a mutation of each known key of each family's config —
wrong type, negative, zero, null, huge, fractional, boolean — is either refused with a
ConfigError naming that key, or (where the rule allows the value) read without any
other kind of error. Values that were accepted silently before: rms_norm_eps -1 / 0 /
null, rope_theta "x", num_hidden_layers 2^40 (which made the reader hang)."""

import pytest
from transformers import AutoConfig

import hf_models
from ftjax.config import HF_VALUE_RULES, ConfigError
from ftjax.models import config_from_hf

MUTATIONS = ["x", -1, 0, None, 2**40, 1.5, True]


def family_config(family: str) -> dict:
    hf = AutoConfig.for_model(family, **{**hf_models.BASE, **hf_models.FAMILY_CONFIGS[family]}).to_dict()
    hf["model_type"] = family
    return hf


@pytest.mark.parametrize("family", sorted(hf_models.FAMILY_CONFIGS))
def test_each_mutation_is_named_or_read(family):
    base = family_config(family)
    config_from_hf(dict(base))  # the unmutated config reads
    tried = 0
    for key, rule in HF_VALUE_RULES.items():
        if key not in base:
            continue
        for value in MUTATIONS:
            hf = {**base, key: value}
            tried += 1
            if rule.why_not(value) is not None:
                with pytest.raises(ConfigError, match=key):
                    config_from_hf(hf)
            else:
                try:
                    config_from_hf(hf)
                except ConfigError:
                    pass  # a valid value that another field's constraint refuses (with its own name)
    assert tried >= 40


@pytest.mark.parametrize("key,value", [("rms_norm_eps", -1), ("rms_norm_eps", 0), ("rms_norm_eps", None),
                                       ("rope_theta", "x"), ("num_hidden_layers", 2**40), ("hidden_size", 1.5)])
def test_values_once_accepted_are_refused_by_name(key, value):
    with pytest.raises(ConfigError, match=f"config.json: {key}"):
        config_from_hf({**family_config("qwen3_moe"), key: value})


def test_nested_values_are_checked():
    hf = family_config("qwen3_moe")
    hf["rope_parameters"] = {**(hf.get("rope_parameters") or {}), "rope_theta": -5}
    with pytest.raises(ConfigError, match="rope_parameters.rope_theta"):
        config_from_hf(hf)
