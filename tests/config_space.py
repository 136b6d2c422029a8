"""A randomized parity harness over each family's config space (issue 37): draw a config
from the family's real space of values, build transformers' reference offline with random
weights, load it with ftjax and check, on a prompt of 24-36 random tokens,

- logits: ftjax's logits of the prompt against transformers' (rel err <= the family's tol);
- greedy: 8 greedy tokens equal transformers' greedy continuation;
- piecewise: a session fed the prompt in two pieces gives the whole prompt's logits;
- batched: generate_many of two prompts of different lengths == each prompt's generate;
- policy: another expert policy (drawn per case, `lru` the most often; a few cache
  slots, pinned bandwidths) gives the device policy's greedy tokens.

Everything follows from (family, seed): the config draw, the weights, the prompts and
the piece split. A failure raises CaseFailure naming the family, the seed, the check and
its error, with the drawn overrides as a Python literal ready to paste into a test
(`check_config(family, overrides, seed=...)` reproduces it), shrunk to a minimal set of
overrides that still fails the same check (FTJAX_PARITY_SHRINK=0 turns shrinking off).

Draws use `random.Random(f"{family}:{seed}:...")` (a string seed is hashed with SHA-512,
the same in every process), so a case is the same on every machine.

What the families' own tests restrict, and how it is mirrored here:
- tolerances: each family's own (TOL, PIECEWISE_TOL below);
- glm_moe_dsa / deepseek_v4: the reference runs under `hf_models.stable_topk` (ties in
  the indexer, as test_glm_dsa's tied geometries do);
- deepseek_v4 is built by test_deepseek_v4's builder (its CONFIG, and the parameters
  transformers initialises to constants perturbed), not hf_models.FAMILY_CONFIGS;
- streamed prefill (refused for deepseek_v4 and IndexShare glm_moe_dsa) is never asked
  for: `prefill="auto"` does not stream on the CPU backend the suite runs on;
- batched rows: test_deepseek_v4 / test_glm_dsa decode batches under `host`; here under
  `device` (nothing refuses it), and the other policy check covers host execution;
- hybrids: every drawn layer pattern has a full-attention layer (transformers' masks
  raise on an all-linear stack; Qwen3-Next / 3.5 releases always have one);
- configs transformers cannot build are outside the space: a crash while building the
  reference is reported as check "reference" (a harness error, not an ftjax bug).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import ftjax
import hf_models
from ftjax.models import config_from_hf

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen3_5_moe_text", "qwen3_next", "glm4_moe",
            "deepseek_v3", "glm_moe_dsa", "deepseek_v4"]
CHECKS = ("logits", "greedy", "piecewise", "batched", "policy")
NEW_TOKENS = 8

# Logits tolerance against transformers: the one the family's own parity tests use
# (test_parity: 1e-4; the hybrids' test_deltanet, test_glm_dsa and test_deepseek_v4: 2e-4).
TOL = {f: 1e-4 for f in FAMILIES} | {"qwen3_5_moe_text": 2e-4, "qwen3_next": 2e-4, "glm_moe_dsa": 2e-4,
                                       "deepseek_v4": 2e-4}
# Piecewise prefill against the whole prompt: 1e-5, and 5e-5 for the hybrids, whose chunked
# delta rule sums in another order when a piece boundary moves (test_deltanet's tolerance).
PIECEWISE_TOL = {f: 1e-5 for f in FAMILIES} | {"qwen3_5_moe_text": 5e-5, "qwen3_next": 5e-5}
# Families whose sparse attention selects keys by a top-k that ties often (relu scores of
# few indexer heads vanish together): the reference is computed with torch.topk keeping
# equal values lowest index first, the rule ftjax's selection follows (dsa.top_k_keep).
TIED_TOPK = {"glm_moe_dsa", "deepseek_v4"}


class CaseFailure(AssertionError):
    def __init__(self, family: str, seed: int, overrides: dict, check: str, error: str, minimal: dict | None = None):
        self.family, self.seed, self.overrides, self.check, self.error = family, seed, overrides, check, error
        self.minimal = minimal
        super().__init__(self.report())

    def report(self) -> str:
        lines = [f"config-space parity failure: family={self.family} seed={self.seed} check={self.check}",
                 f"  error: {self.error}",
                 "  reproduce (paste into a test):",
                 "    " + paste_line(self.family, self.overrides, self.seed, 4)]
        if self.minimal is not None and self.minimal != self.overrides:
            lines += ["  minimal overrides that still fail this check:",
                      "    " + paste_line(self.family, self.minimal, self.seed, 4)]
        return "\n".join(lines)


def paste_line(family: str, overrides: dict, seed: int, indent: int = 0, width: int = 110) -> str:
    """`config_space.check_config(family, dict(...), seed=...)`, wrapped at `width`."""
    head, tail = f"config_space.check_config({family!r}, dict(", f"), seed={seed})"
    items = [f"{k}={v!r}" + (", " if i < len(overrides) - 1 else "") for i, (k, v) in enumerate(overrides.items())]
    lines, line = [], head
    for item in items:
        if indent + len(line) + len(item) > width and line.strip() != head:
            lines.append(line.rstrip())
            line = " " * len(head) + item
        else:
            line += item
    lines.append(line + tail)
    return ("\n" + " " * indent).join(lines)


# ---- the config spaces ---------------------------------------------------------------------------

def _gqa(rng: random.Random, head_dim: bool, max_heads: int = 8) -> dict:
    """Attention geometry of a GQA family: hidden size, kv heads, GQA ratio (heads a
    multiple of kv heads), and an explicit even head_dim where the family reads one (else
    hidden / heads, drawn even)."""
    hidden = rng.choice([32, 48, 64])
    shapes = [(kv, kv * r) for kv in (1, 2, 3, 4) for r in (1, 2, 4) if kv * r <= max_heads
              and (head_dim or (hidden % (kv * r) == 0 and (hidden // (kv * r)) % 2 == 0))]
    kv, heads = rng.choice(shapes)
    out = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv)
    if head_dim:
        out["head_dim"] = rng.choice([4, 8, 12, 16])
    return out


def _experts(rng: random.Random, key: str, max_k: int = 4) -> dict:
    e = rng.randint(2, 8)
    return {key: e, "num_experts_per_tok": rng.randint(1, min(max_k, e))}


def _layers(rng: random.Random, low: int = 1, high: int = 3) -> int:
    return rng.randint(low, high)


def _dense_layers(rng: random.Random, L: int) -> list[int]:
    """A subset of the layers made dense (mlp_only_layers), at least one left MoE."""
    return sorted(rng.sample(range(L), rng.randint(0, L - 1)))


def _rope_theta(rng: random.Random) -> float:
    return rng.choice([10000.0, 500000.0, 1000000.0])


def _deepseek_routing(rng: random.Random, L: int) -> dict:
    """DeepSeek-style sigmoid group routing: experts split into n_group groups of >= 2
    (transformers scores a group by its top 2), topk_group <= n_group, top-k no more than
    the eligible groups hold."""
    choices = [(e, g) for e in (4, 6, 8) for g in (1, 2, 3, 4) if e % g == 0 and e // g >= 2]
    e, g = rng.choice(choices)
    tg = rng.randint(1, g)
    k = rng.randint(1, min(4, tg * (e // g)))
    return dict(n_routed_experts=e, n_group=g, topk_group=tg, num_experts_per_tok=k,
                moe_intermediate_size=rng.choice([8, 16, 24]), intermediate_size=rng.choice([24, 40]),
                n_shared_experts=rng.choice([0, 1, 2]), first_k_dense_replace=rng.randint(0, min(2, L - 1)),
                routed_scaling_factor=rng.choice([1.0, 1.5, 2.5]), norm_topk_prob=rng.random() < 0.7)


def _yarn(rng: random.Random, mscale: bool, **extra) -> dict:
    p = dict(rope_type="yarn", factor=rng.choice([2.0, 4.0, 8.0]),
             original_max_position_embeddings=rng.choice([16, 32]), rope_theta=_rope_theta(rng))
    if rng.random() < 0.5:
        p.update(beta_fast=rng.choice([16, 32]), beta_slow=rng.choice([1, 2]))
    if mscale and rng.random() < 0.6:
        p.update(mscale=rng.choice([0.707, 1.0]), mscale_all_dim=rng.choice([0.707, 1.0]))
    return p | extra


def _mla(rng: random.Random, q_lora_none: bool) -> dict:
    heads = rng.choice([2, 4, 8])
    return dict(hidden_size=rng.choice([32, 48, 64]), num_attention_heads=heads, num_key_value_heads=heads,
                q_lora_rank=rng.choice(([None] if q_lora_none else []) + [8, 12, 16]),
                kv_lora_rank=rng.choice([8, 16, 24]), qk_nope_head_dim=rng.choice([4, 8, 12]),
                qk_rope_head_dim=rng.choice([2, 4, 8]), v_head_dim=rng.choice([4, 6, 10]))


def _qwen3_moe(rng):
    L = _layers(rng)
    c = dict(num_hidden_layers=L, **_gqa(rng, head_dim=True), **_experts(rng, "num_experts"),
             moe_intermediate_size=rng.choice([8, 16, 24]), intermediate_size=rng.choice([24, 40]),
             norm_topk_prob=rng.random() < 0.5, mlp_only_layers=_dense_layers(rng, L),
             attention_bias=rng.random() < 0.3, tie_word_embeddings=rng.random() < 0.3,
             rope_theta=_rope_theta(rng))
    if L > 1 and not c["mlp_only_layers"] and rng.random() < 0.3:
        c["decoder_sparse_step"] = 2  # every other layer MoE (layer 1)
    if rng.random() < 0.4:
        c.update(use_sliding_window=True, sliding_window=rng.choice([3, 7, 12, 64]))
    return c


def _qwen2_moe(rng):
    L = _layers(rng)
    c = dict(num_hidden_layers=L, **_gqa(rng, head_dim=False), **_experts(rng, "num_experts"),
             moe_intermediate_size=rng.choice([8, 16, 24]), intermediate_size=rng.choice([24, 40]),
             shared_expert_intermediate_size=rng.choice([0, 16, 24]), norm_topk_prob=rng.random() < 0.5,
             mlp_only_layers=_dense_layers(rng, L), qkv_bias=rng.random() < 0.7,
             tie_word_embeddings=rng.random() < 0.3, rope_theta=_rope_theta(rng))
    if rng.random() < 0.4:  # sliding on the even layers below max_window_layers (transformers' layer_types)
        c.update(use_sliding_window=True, sliding_window=rng.choice([3, 7, 12, 64]),
                 max_window_layers=rng.randint(1, L))
    return c


def _mixtral(rng):
    c = dict(num_hidden_layers=_layers(rng), **_gqa(rng, head_dim=rng.random() < 0.5),
             **_experts(rng, "num_local_experts"), intermediate_size=rng.choice([8, 16, 24]),
             tie_word_embeddings=rng.random() < 0.3, rope_theta=_rope_theta(rng),
             sliding_window=rng.choice([None, None, 3, 7, 12, 64]))
    return c


def _olmoe(rng):
    return dict(num_hidden_layers=_layers(rng), **_gqa(rng, head_dim=False), **_experts(rng, "num_experts"),
                intermediate_size=rng.choice([8, 16, 24]), norm_topk_prob=rng.random() < 0.5,
                clip_qkv=rng.choice([None, 0.5, 2.0, 8.0]), attention_bias=rng.random() < 0.3,
                tie_word_embeddings=rng.random() < 0.3, rope_theta=_rope_theta(rng))


def _hybrid(rng, family):
    """Gated DeltaNet hybrids: any pattern of linear / full attention layers, partial
    rotary, linear-attention head counts and widths, routed + gated shared experts."""
    L = _layers(rng, 2)
    c = dict(num_hidden_layers=L, **_gqa(rng, head_dim=True), **_experts(rng, "num_experts"),
             moe_intermediate_size=rng.choice([8, 16, 24]), shared_expert_intermediate_size=rng.choice([8, 16, 24]),
             layer_types=[rng.choice(["linear_attention", "full_attention"]) for _ in range(L)],
             tie_word_embeddings=rng.random() < 0.3, attention_bias=rng.random() < 0.2)
    if "full_attention" not in c["layer_types"]:  # transformers' masks need one attention layer
        c["layer_types"][rng.randrange(L)] = "full_attention"
    factors = [f for f in (0.25, 0.5, 1.0) if (c["head_dim"] * f) % 2 == 0]
    c["rope_parameters"] = dict(rope_type="default", rope_theta=_rope_theta(rng),
                                partial_rotary_factor=rng.choice(factors))
    kh = rng.choice([1, 2, 4])
    c.update(linear_num_key_heads=kh, linear_num_value_heads=kh * rng.choice([1, 2]),
             linear_key_head_dim=rng.choice([4, 8, 16]), linear_value_head_dim=rng.choice([4, 6, 8]),
             linear_conv_kernel_dim=rng.choice([2, 3, 4]), mtp_num_hidden_layers=rng.choice([0, 1]))
    if family == "qwen3_next":
        c.update(intermediate_size=rng.choice([24, 40]), mlp_only_layers=_dense_layers(rng, L),
                 norm_topk_prob=rng.random() < 0.7)
    return c


def _glm4_moe(rng):
    L = _layers(rng)
    c = dict(num_hidden_layers=L, **_gqa(rng, head_dim=True), **_deepseek_routing(rng, L),
             use_qk_norm=rng.random() < 0.5, attention_bias=rng.random() < 0.5,
             tie_word_embeddings=rng.random() < 0.3, num_nextn_predict_layers=rng.choice([0, 1]))
    factors = [f for f in (0.25, 0.5, 1.0) if (c["head_dim"] * f) % 2 == 0]
    factor = rng.choice(factors)
    c["rope_parameters"] = (_yarn(rng, mscale=False, partial_rotary_factor=factor) if rng.random() < 0.4 else
                            dict(rope_type="default", rope_theta=_rope_theta(rng), partial_rotary_factor=factor))
    return c


def _deepseek_v3(rng):
    L = _layers(rng)
    c = dict(num_hidden_layers=L, **_mla(rng, q_lora_none=True), **_deepseek_routing(rng, L),
             rope_interleave=rng.random() < 0.6, attention_bias=rng.random() < 0.3,
             tie_word_embeddings=rng.random() < 0.2, num_nextn_predict_layers=rng.choice([0, 1]))
    c["rope_parameters"] = (_yarn(rng, mscale=True) if rng.random() < 0.4 else
                            dict(rope_type="default", rope_theta=_rope_theta(rng)))
    return c


def _glm_moe_dsa(rng):
    """MLA + the lightning indexer: its top-k below the prompt (keys dropped) or above it
    (dense), few or many indexer heads (ties at score 0), IndexShare layer patterns."""
    L = _layers(rng)
    c = dict(num_hidden_layers=L, **_mla(rng, q_lora_none=False), **_deepseek_routing(rng, L),
             attention_bias=rng.random() < 0.3, tie_word_embeddings=rng.random() < 0.2,
             num_nextn_predict_layers=rng.choice([0, 1]))
    c.update(index_n_heads=rng.choice([1, 2, 4, 8, 16]),
             index_head_dim=rng.choice([d for d in (8, 12, 16, 32) if d > c["qk_rope_head_dim"]]),
             index_topk=rng.choice([2, 3, 6, 11, 17]) if rng.random() < 0.75 else rng.choice([48, 64]))
    if L > 1 and rng.random() < 0.3:
        c["indexer_types"] = ["full"] + [rng.choice(["full", "shared"]) for _ in range(L - 1)]
    if rng.random() < 0.3:  # dense layers named per layer instead of first_k_dense_replace
        types = [rng.choice(["dense", "sparse"]) for _ in range(L)]
        types[rng.randrange(L)] = "sparse"
        c["mlp_layer_types"] = types
        del c["first_k_dense_replace"]
    c["rope_parameters"] = (_yarn(rng, mscale=True) if rng.random() < 0.4 else
                            dict(rope_type="default", rope_theta=_rope_theta(rng)))
    return c


DSV4_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def _deepseek_v4(rng):
    """Sliding / compressed-sparse / heavily-compressed layers in any order, hash or
    score routing per layer, hyper-connection streams, compress rates, the CSA indexer's
    top-k below the entries a prompt makes (>= 3 even at 24 tokens, rate 8) or above."""
    L = _layers(rng)
    heads = rng.choice([2, 4, 8])
    head_dim = rng.choice([8, 16, 32])
    factor = rng.choice([f for f in (0.25, 0.5) if head_dim * f >= 2 and (head_dim * f) % 2 == 0])
    e = rng.randint(3, 8)
    c = dict(num_hidden_layers=L, hidden_size=rng.choice([32, 48, 64]), num_attention_heads=heads,
             head_dim=head_dim, partial_rotary_factor=factor, q_lora_rank=rng.choice([8, 12, 16]),
             o_groups=rng.choice([g for g in (1, 2, 4) if heads % g == 0]), o_lora_rank=rng.choice([4, 8]),
             n_routed_experts=e, num_experts_per_tok=rng.randint(1, min(3, e)),
             moe_intermediate_size=rng.choice([8, 16, 24]), sliding_window=rng.choice([3, 6, 9, 64]),
             index_n_heads=rng.choice([2, 4, 8, 16]),
             index_head_dim=rng.choice([d for d in (8, 16, 32) if d > head_dim * factor]),
             hc_mult=rng.choice([1, 2, 3, 4]), hc_sinkhorn_iters=rng.choice([5, 20]),
             layer_types=[rng.choice(DSV4_TYPES) for _ in range(L)],
             compress_rates={"compressed_sparse_attention": rng.choice([4, 8]),
                             "heavily_compressed_attention": rng.choice([8, 16])},
             mlp_layer_types=[rng.choice(["hash_moe", "moe"]) for _ in range(L)],
             scoring_func=rng.choice(["sqrtsoftplus", "sigmoid"]), swiglu_limit=rng.choice([10.0, 1.0]),
             routed_scaling_factor=rng.choice([1.0, 1.5, 2.5]), compress_rope_theta=rng.choice([160000.0, 10000.0]),
             num_nextn_predict_layers=rng.choice([0, 1]))
    entries = 24 // c["compress_rates"]["compressed_sparse_attention"]
    c["index_topk"] = rng.randint(1, entries - 1) if rng.random() < 0.75 else 64
    if rng.random() < 0.3:
        c["rope_parameters"] = _yarn(rng, mscale=False)
    return c


SPACES = {"qwen3_moe": _qwen3_moe, "qwen2_moe": _qwen2_moe, "mixtral": _mixtral, "olmoe": _olmoe,
          "qwen3_5_moe_text": lambda rng: _hybrid(rng, "qwen3_5_moe_text"),
          "qwen3_next": lambda rng: _hybrid(rng, "qwen3_next"), "glm4_moe": _glm4_moe,
          "deepseek_v3": _deepseek_v3, "glm_moe_dsa": _glm_moe_dsa, "deepseek_v4": _deepseek_v4}


def case_rng(family: str, seed: int, what: str = "config") -> random.Random:
    return random.Random(f"{family}:{seed}:{what}")


def draw_config(family: str, rng: random.Random) -> dict:
    """HF config overrides (over hf_models.BASE + FAMILY_CONFIGS, or test_deepseek_v4's
    CONFIG) drawn from the family's space."""
    return SPACES[family](rng)


# ---- building the reference --------------------------------------------------------------------

def hf_config(family: str, overrides: dict):
    """transformers' config of (family, overrides), no weights built."""
    from transformers import AutoConfig
    if family == "deepseek_v4":
        import test_deepseek_v4
        base = test_deepseek_v4.CONFIG
    else:
        base = {**hf_models.BASE, **hf_models.FAMILY_CONFIGS[family]}
    return AutoConfig.for_model(family, **{**base, **overrides})


def build(family: str, seed: int, overrides: dict):
    if family == "deepseek_v4":
        import test_deepseek_v4  # its builder perturbs the parameters transformers initialises to constants
        return test_deepseek_v4.build(seed=seed, **overrides)
    return hf_models.build(family, seed=seed, **overrides)


def add_mtp_tensors(hf, path: Path) -> None:
    """What a released checkpoint whose config announces multi-token-prediction layers
    holds (transformers builds none): GLM / DeepSeek-V3 style, layers L.. after the last
    decoder layer (a copy of the last layer plus eh_proj / enorm / hnorm); Qwen3-Next /
    3.5 and DeepSeek-V4, an `mtp.*` module. ftjax must skip them."""
    cfg = hf.config
    n = int(getattr(cfg, "num_nextn_predict_layers", 0) or getattr(cfg, "mtp_num_hidden_layers", 0) or 0)
    if n <= 0:
        return
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == 1, files
    sd = load_file(str(files[0]))
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    last = [k for k in sd if f"layers.{L - 1}." in k]
    if cfg.model_type in ("glm4_moe", "deepseek_v3", "glm_moe_dsa"):
        for i in range(n):
            for k in last:
                sd[k.replace(f"layers.{L - 1}.", f"layers.{L + i}.")] = sd[k].clone()
            for name, shape in (("eh_proj.weight", (D, 2 * D)), ("enorm.weight", (D,)), ("hnorm.weight", (D,)),
                                ("shared_head.norm.weight", (D,))):
                sd[f"model.layers.{L + i}.{name}"] = torch.ones(shape)
    else:
        for k in last:
            sd["mtp." + ("layers.0." if "qwen3" in cfg.model_type else "0.") + k.split(f"layers.{L - 1}.", 1)[1]] = \
                sd[k].clone()
        sd["mtp.fc.weight" if "qwen3" in cfg.model_type else "mtp.0.e_proj.weight"] = torch.ones((D, 2 * D))
        sd["mtp.norm.weight" if "qwen3" in cfg.model_type else "mtp.0.norm.weight"] = torch.ones((D,))
    save_file(sd, str(files[0]), metadata={"format": "pt"})


# ---- the checks ------------------------------------------------------------------------------------

def rel_err(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / np.abs(b).max())


class _Failed(Exception):
    def __init__(self, check: str, error: str):
        super().__init__(f"{check}: {error}")
        self.check, self.error = check, error


def _expect(ok: bool, check: str, error) -> None:
    if not ok:
        raise _Failed(check, error() if callable(error) else error)


def prompts(family: str, seed: int) -> tuple[list[int], list[int], int]:
    """(prompt of 24-36 tokens, a shorter second prompt for the batch, the piece split)."""
    rng = case_rng(family, seed, "prompt")
    n = rng.randint(24, 36)
    prompt = [rng.randrange(96) for _ in range(n)]
    short = [rng.randrange(96) for _ in range(rng.randint(5, n - 5))]
    return prompt, short, rng.randint(1, n - 1)


def _run_checks(family: str, seed: int, overrides: dict, checks, tmp: Path, stage: list) -> None:
    """The checks; `stage[0]` names what runs (so an exception is reported as a crash of
    that stage: "reference" is transformers' side, a harness error, the rest ftjax's)."""
    stage[0] = "reference"
    hf = build(family, seed, overrides)
    path = hf_models.save(hf, tmp / "ckpt")
    add_mtp_tensors(hf, path)
    prompt, short, split = prompts(family, seed)
    n = NEW_TOKENS
    with hf_models.stable_topk() if family in TIED_TOPK else contextlib.nullcontext():
        want_logits = hf_models.hf_logits(hf, prompt).numpy()
        want_tokens = hf_models.hf_greedy(hf, prompt, n) if {"greedy", "policy"} & set(checks) else None
    del hf
    stage[0] = "logits"
    model = ftjax.load(path)
    whole = model.logits(prompt)
    tol = TOL[family]
    if "logits" in checks:
        err = rel_err(whole, want_logits)
        _expect(err <= tol, "logits", lambda: f"rel err {err:.3g} > {tol:g} vs transformers "
                f"(prompt of {len(prompt)}; worst position {int(np.abs(whole - want_logits).max(-1).argmax())})")
    stage[0] = "greedy"
    tokens = model.generate(prompt, n) if {"greedy", "batched", "policy"} & set(checks) else None
    if "greedy" in checks:
        _expect(tokens == want_tokens, "greedy", lambda: f"ftjax {tokens} != transformers {want_tokens} "
                f"(first difference at step {next(i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b)})")
    if "piecewise" in checks:
        stage[0] = "piecewise"
        s = model.session()
        s.append(prompt[:split])
        pieces = s.logits(prompt[split:])
        err, ptol = rel_err(pieces, whole[split:]), PIECEWISE_TOL[family]
        _expect(err <= ptol, "piecewise", lambda: f"pieces [:{split}] + [{split}:] vs whole prompt of "
                f"{len(prompt)}: rel err {err:.3g} > {ptol:g}")
    if "batched" in checks:
        stage[0] = "batched"
        single = [tokens, model.generate(short, n)]
        many = model.generate_many([prompt, short], n)
        _expect(many == single, "batched", lambda: f"generate_many([prompt of {len(prompt)}, prompt of {len(short)}]) "
                f"= {many} != each generate {single}")
    del model
    if "policy" in checks:
        stage[0] = "policy"
        kw = policy_options(family, seed, path)
        other = ftjax.load(path, threads=1, **kw)
        got = other.generate(prompt, n)
        _expect(got == tokens, "policy", lambda: f"{_kw_text(kw)}: {got} != device {tokens}")


# The policies besides `device` (ftjax.experts.policy.POLICIES), lru the most often: a case
# draws one, with a small cache and pinned bandwidths (the adaptive split's q is then fixed).
OTHER_POLICIES = ["lru", "lru", "lru", "host", "lru-transfer-only", "lru-host-only", "static-layer",
                  "static-frequency"]


def policy_options(family: str, seed: int, path: Path) -> dict:
    from ftjax.experts.policy import POLICIES
    rng = case_rng(family, seed, "policy")
    name = rng.choice(OTHER_POLICIES)
    L, E = _pool_shape(path)
    kw = dict(policy=name, bandwidth=(1.0, 2.0))
    if POLICIES[name].uses_slots:
        kw["cache_slots"] = rng.randint(1, max(1, L * E // 2))
    if name == "static-frequency":
        kw["frequency"] = np.array([[rng.randint(0, 9) for _ in range(E)] for _ in range(L)], np.int64)
    return kw


def _kw_text(kw: dict) -> str:
    return ", ".join(f"{k}={v.tolist() if isinstance(v, np.ndarray) else v!r}" for k, v in kw.items())


def _pool_shape(path: Path) -> tuple[int, int]:
    """(MoE layers, experts per layer) of the saved checkpoint, as ftjax reads them."""
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
    return sum(cfg.moe_layers), cfg.num_experts


def _attempt(family: str, seed: int, overrides: dict, checks) -> _Failed | None:
    stage = ["reference"]
    with tempfile.TemporaryDirectory(prefix="ftjax-config-space-") as tmp:
        try:
            _run_checks(family, seed, overrides, checks, Path(tmp), stage)
        except _Failed as f:
            return f
        except Exception as e:  # a crash: in transformers' side (a harness error) or in ftjax
            where = "transformers (reference)" if stage[0] == "reference" else "ftjax"
            return _Failed(stage[0], f"{where} raised {type(e).__name__}: {e}")
        finally:
            gc.collect()
    return None


def shrink(family: str, seed: int, overrides: dict, failure: _Failed, checks) -> dict:
    """Drop override keys (back to the family's tiny default) one at a time while the same
    check still fails: the smallest config to paste into a test. Checks after the failing
    one are not run."""
    upto = tuple(c for c in CHECKS if c in checks)
    if failure.check in upto:
        upto = upto[:upto.index(failure.check) + 1]
    current = dict(overrides)
    for key in list(overrides):
        trial = {k: v for k, v in current.items() if k != key}
        f = _attempt(family, seed, trial, upto)
        if f is not None and f.check == failure.check:
            current = trial
    return current


def check_config(family: str, overrides: dict, seed: int = 0, checks=CHECKS, shrink_failures: bool | None = None):
    """Build (family, overrides) with weight seed `seed`, run `checks`; a failure raises
    CaseFailure (with the minimal failing overrides unless shrinking is off)."""
    failure = _attempt(family, seed, overrides, checks)
    if failure is None:
        return
    if shrink_failures is None:
        shrink_failures = os.environ.get("FTJAX_PARITY_SHRINK", "1") != "0"
    minimal = shrink(family, seed, overrides, failure, checks) if shrink_failures else None
    raise CaseFailure(family, seed, overrides, failure.check, failure.error, minimal)


def run_case(family: str, seed: int, checks=CHECKS) -> dict:
    """Draw (family, seed)'s config and check it; returns the overrides."""
    overrides = draw_config(family, case_rng(family, seed))
    check_config(family, overrides, seed, checks)
    return overrides


def run_sample(families, seeds, checks=CHECKS, log=print) -> dict:
    """Run every (family, seed); returns {family: [(seed, overrides, CaseFailure | None, secs)]}."""
    results: dict = {}
    for family in families:
        for seed in seeds:
            t0 = time.perf_counter()
            overrides = draw_config(family, case_rng(family, seed))
            try:
                check_config(family, overrides, seed, checks)
                failure = None
            except CaseFailure as f:
                failure = f
            secs = time.perf_counter() - t0
            results.setdefault(family, []).append((seed, overrides, failure, secs))
            log(f"{family} seed={seed}: {'ok' if failure is None else 'FAIL ' + failure.check} ({secs:.1f} s)"
                + ("" if failure is None else "\n" + failure.report()))
    return results
