"""Correct on every config, not just the tested one (issue 37): a randomized parity harness
over the ten families' config spaces (`config_space`: head counts and dims, GQA ratios,
rope fractions and YaRN, q/kv LoRA ranks, group routing, shared experts, dense-first
layers, sliding windows, indexer sizes and top-k below and above the prompt, MTP and hash
layers, hybrid layer patterns). Each drawn config is built with transformers (random
weights, offline) and checked: logits, greedy tokens, piecewise == whole prefill,
batched == single, another expert policy (lru, host, static ...) == the device policy.

- `test_ci_sample`: a fixed sample, 2 seeds per family (20 configs), the checks against
  transformers and the piecewise prefill. The first seed is in the default suite (10
  configs, about a minute and a half on one busy core), the second under `-m slow`.
- `test_ci_sample_batched_and_policy` (`slow`): the first seed's batched and policy
  checks (a compile each: 40% of a case; every family's own tests cover both on its
  fixed geometries in the default suite).
- `test_large_sample` (`slow`, run with `-m slow`): FTJAX_PARITY_PER_FAMILY (20) seeds per
  family from FTJAX_PARITY_SEED (default 1000), every check, 200 configs. The seed base is
  printed at the start and each test id names its seed.

A failure prints the family, the seed, the failed check and its error, and the overrides
as a `config_space.check_config(...)` line to paste into a test, shrunk to the fewest
overrides that still fail that check."""

import ast
import contextlib
import json
import os

import pytest

import config_space
from config_space import CHECKS, FAMILIES

CI_SEEDS = (0, 1)
CI_CHECKS = ("logits", "greedy", "piecewise")
pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors:UserWarning")  # 0 shared experts
SEED_BASE = int(os.environ.get("FTJAX_PARITY_SEED", "1000"))
PER_FAMILY = int(os.environ.get("FTJAX_PARITY_PER_FAMILY", "20"))


@pytest.fixture(scope="module", autouse=True)
def _name_the_seeds(request):
    """The seeds on the terminal (past output capture), before the first case runs."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None:
        with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
            reporter.write_line(f"\nconfig-space parity: CI seeds {CI_SEEDS}; large sample "
                                f"FTJAX_PARITY_SEED={SEED_BASE} (seeds {SEED_BASE}..{SEED_BASE + PER_FAMILY - 1} "
                                "per family)")
    yield


@pytest.mark.parametrize("family,seed", [pytest.param(f, s, marks=[pytest.mark.slow] if s else [])
                                         for f in FAMILIES for s in CI_SEEDS],
                         ids=[f"{f}-seed{s}" for f in FAMILIES for s in CI_SEEDS])
def test_ci_sample(family, seed):
    config_space.run_case(family, seed, CI_CHECKS)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_ci_sample_batched_and_policy(family):
    config_space.run_case(family, CI_SEEDS[0], tuple(c for c in CHECKS if c not in CI_CHECKS))


@pytest.mark.slow
@pytest.mark.parametrize("family,seed", [(f, SEED_BASE + i) for f in FAMILIES for i in range(PER_FAMILY)],
                         ids=[f"{f}-seed{SEED_BASE + i}" for f in FAMILIES for i in range(PER_FAMILY)])
def test_large_sample(family, seed):
    config_space.run_case(family, seed)  # 200 configs: about 45 minutes on one core


# ---- the harness itself (no model is built) ----------------------------------------------------

DRAWS = 150


def _draws(family):
    return [config_space.draw_config(family, config_space.case_rng(family, seed)) for seed in range(DRAWS)]


@pytest.mark.parametrize("family", FAMILIES)
def test_draws_are_reproducible_and_valid(family):
    """Each draw is a function of (family, seed), a Python literal, and a config both
    transformers and ftjax's reader accept (every consistency rule of the space holds);
    every key the space draws takes at least two values."""
    from ftjax.models import config_from_hf

    draws = _draws(family)
    assert draws == _draws(family)
    for overrides in draws:
        assert ast.literal_eval(repr(overrides)) == overrides
        cfg = config_from_hf(json.loads(json.dumps(config_space.hf_config(family, overrides).to_dict())))
        assert cfg.num_experts >= cfg.top_k and any(cfg.moe_layers)
    for key in {k for d in draws for k in d}:
        values = {repr(d.get(key)) for d in draws}
        assert len(values) >= 2, (key, values)


def _share(draws, predicate) -> float:
    return sum(map(predicate, draws)) / len(draws)


def test_draws_reach_the_corners():
    """The spaces reach what the issue names: GQA and MHA, explicit head_dim, windows and
    indexer top-k below and above the prompt (24..36 tokens), no q LoRA, YaRN, dense-first
    and all-MoE stacks, 0 / 1 / 2 shared experts, IndexShare, MTP layers, hybrid patterns,
    every DeepSeek-V4 layer type and hash routing."""
    d = {f: _draws(f) for f in FAMILIES}
    assert _share(d["qwen3_moe"], lambda c: c["num_key_value_heads"] < c["num_attention_heads"]) > 0.3
    assert _share(d["qwen3_moe"], lambda c: c["num_key_value_heads"] == c["num_attention_heads"]) > 0.1
    for fam in ("qwen3_moe", "qwen2_moe", "mixtral"):
        windows = [c.get("sliding_window") for c in d[fam] if c.get("sliding_window") is not None]
        assert min(windows) < 24 and max(windows) > 36, fam
    dsa = [c["index_topk"] for c in d["glm_moe_dsa"]]
    assert min(dsa) < 24 and max(dsa) > 36
    v4 = d["deepseek_v4"]
    entries = [24 // c["compress_rates"]["compressed_sparse_attention"] for c in v4]
    assert any(c["index_topk"] < n for c, n in zip(v4, entries)) and any(c["index_topk"] > 36 for c in v4)
    assert {t for c in v4 for t in c["layer_types"]} == set(config_space.DSV4_TYPES)
    assert _share(v4, lambda c: "hash_moe" in c["mlp_layer_types"]) > 0.3
    assert _share(d["glm_moe_dsa"], lambda c: "shared" in c.get("indexer_types", [])) > 0.05
    assert _share(d["deepseek_v3"], lambda c: c["q_lora_rank"] is None) > 0.1
    for fam in ("glm4_moe", "deepseek_v3", "glm_moe_dsa"):
        assert _share(d[fam], lambda c: c["rope_parameters"]["rope_type"] == "yarn") > 0.2, fam
        assert {c["n_shared_experts"] for c in d[fam]} == {0, 1, 2}, fam
        assert _share(d[fam], lambda c: c.get("num_nextn_predict_layers")) > 0.2, fam
        assert _share(d[fam], lambda c: c["n_group"] > 1 and c["topk_group"] < c["n_group"]) > 0.2, fam
    assert {c.get("first_k_dense_replace") for c in d["deepseek_v3"]} == {0, 1, 2}
    for fam in ("qwen3_next", "qwen3_5_moe_text"):
        patterns = {tuple(c["layer_types"]) for c in d[fam]}
        assert len(patterns) >= 8 and any(len(set(p)) == 2 for p in patterns), fam
        assert {c["rope_parameters"]["partial_rotary_factor"] for c in d[fam]} == {0.25, 0.5, 1.0}, fam


def test_a_failure_names_the_case_and_shrinks_to_a_pasteable_config(monkeypatch):
    """The report: family, seed, check, error, and check_config lines whose overrides are
    Python literals; shrinking keeps exactly the overrides the failure needs."""
    def attempt(family, seed, overrides, checks):  # "fails" while clip_qkv is 0.5 and top-k 1
        if overrides.get("clip_qkv") == 0.5 and overrides.get("num_experts_per_tok") == 1:
            return config_space._Failed("greedy", "ftjax [1] != transformers [2]")
        return None

    monkeypatch.setattr(config_space, "_attempt", attempt)
    overrides = dict(num_hidden_layers=2, clip_qkv=0.5, num_experts=3, num_experts_per_tok=1, rope_theta=1e6,
                     sliding_window=None, rope_parameters=dict(rope_type="yarn", factor=4.0), layer_types=["a", "b"],
                     mlp_only_layers=[0], hidden_size=48, num_attention_heads=6)  # wraps over lines
    with pytest.raises(config_space.CaseFailure) as info:
        config_space.check_config("olmoe", overrides, seed=7)
    failure = info.value
    assert failure.minimal == dict(clip_qkv=0.5, num_experts_per_tok=1)
    text = str(failure)
    assert "family=olmoe seed=7 check=greedy" in text and "ftjax [1] != transformers [2]" in text
    pasted = []  # each reproduce snippet, run as pasted into a test, calls check_config with its case
    snippets = text.split("config_space.check_config(")[1:]
    for snippet in snippets:
        source = "config_space.check_config(" + snippet[:snippet.index(", seed=7)") + len(", seed=7)")]
        exec(source, {"config_space": type("Fake", (), {"check_config": staticmethod(
            lambda family, overrides, seed: pasted.append((family, overrides, seed)))})})
    assert pasted == [("olmoe", overrides, 7), ("olmoe", failure.minimal, 7)]
    config_space.check_config("olmoe", dict(clip_qkv=0.5), seed=7)  # passes: no exception
