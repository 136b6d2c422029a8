"""Model configuration: one frozen, hashable dataclass built from a Hugging Face config.json.

Design: every family (qwen3_moe, qwen2_moe, mixtral, olmoe, the hybrids, glm4_moe,
deepseek_v3, glm_moe_dsa; deepseek_v4 adds hyper-connections to it) is the same decoder with a few switches (q/k norm kind, qkv bias, shared
expert, which layers are MoE, sliding windows, the router kind, the layer kinds).
Sub-dataclasses hold what only some families have: `DeltaNetConfig` (linear
attention), `MLAConfig` (multi-head latent attention), `DSAConfig` (the sparse-attention
indexer of GLM-5), `DSV4Config` (DeepSeek-V4's compressed attention, hyper-connections and
routing), `RopeScaling` (YaRN). `ModelConfig` holds those switches as plain data so the model code never
branches on `model_type`; each family file only translates its HF config and tensor
names into this form. Because the dataclass is frozen and hashable it can be closed
over by jitted functions without retracing.

Real checkpoints spell the same field several ways (`num_experts` vs
`num_local_experts`, `rope_theta` at the top level or inside `rope_parameters`), so
`hf_get` looks a field up through its known aliases.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

# Field -> the names real HF configs use for it, in order of preference.
HF_ALIASES: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    "top_k": ("num_experts_per_tok", "moe_top_k", "top_k", "num_selected_experts"),
    "d_ff_expert": ("moe_intermediate_size", "expert_intermediate_size"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads", "n_kv_heads"),
    "num_heads": ("num_attention_heads", "n_heads", "n_head"),
    "num_layers": ("num_hidden_layers", "n_layers", "n_layer"),
    "d_model": ("hidden_size", "d_model", "n_embd"),
    "max_position": ("max_position_embeddings", "max_seq_len", "n_positions"),
    "rms_norm_eps": ("rms_norm_eps", "layer_norm_epsilon", "norm_eps"),
    "tie_embeddings": ("tie_word_embeddings",),
}


class ConfigError(ValueError):
    """A config.json that ftjax cannot run, with the reason and the file."""


MAX_SIZE = 2**31 - 1  # every size and count must fit an int32 (array dimensions, token ids)
MAX_LAYERS = 4096


@dataclasses.dataclass(frozen=True)
class Rule:
    """What a config.json value may be: an integer or a number in [low, high] (`above`:
    strictly above low), or null where the key has a meaning when absent."""

    kind: str  # "int" | "float" | "bool"
    low: float = 0
    high: float = MAX_SIZE
    above: bool = False
    nullable: bool = True

    def why_not(self, value: Any) -> str | None:
        """None if value is allowed, else what it must be."""
        if value is None:
            return None if self.nullable else "must be given (not null)"
        if self.kind == "bool":
            return None if isinstance(value, bool) else "must be true or false"
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if self.kind == "int" and not (number and float(value).is_integer()):
            return "must be an integer"
        if not number or not math.isfinite(value):
            return "must be a finite number"
        lo = f"> {self.low:g}" if self.above else f">= {self.low:g}"
        if value < self.low or (self.above and value == self.low) or value > self.high:
            return f"must be {lo} and <= {self.high:g}"
        return None


_SIZE, _COUNT = Rule("int", 1), Rule("int", 0)  # a positive size; a count that may be 0
_SIZE_GIVEN = Rule("int", 1, nullable=False)  # a size a reader needs when the key is there
_POSITIVE = Rule("float", 0, float("inf"), above=True, nullable=False)
# Every scalar a family reader takes from config.json, by its Hugging Face name (aliases
# included): checked before any reader runs, so a bad value is an error naming its key,
# never a conversion error or a shape error inside a step.
HF_VALUE_RULES: dict[str, Rule] = {
    **{k: Rule("int", 1, nullable=False) for k in ("vocab_size", "hidden_size", "num_attention_heads")},
    "num_hidden_layers": Rule("int", 1, MAX_LAYERS, nullable=False),
    **{k: _SIZE for k in ("num_key_value_heads", "head_dim", "max_position_embeddings", "q_lora_rank", "n_group",
                          "topk_group", "decoder_sparse_step", "o_lora_rank", "o_groups", "index_topk_freq")},
    "qk_nope_head_dim": Rule("int", 0, nullable=False),
    **{k: _SIZE_GIVEN for k in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
                                "index_topk", "num_experts_per_tok", "moe_intermediate_size", "linear_num_key_heads",
                                "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                                "linear_conv_kernel_dim", "hc_mult", "hc_sinkhorn_iters")},
    **{k: _COUNT for k in ("intermediate_size", "shared_expert_intermediate_size",
                           "num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts",
                           "first_k_dense_replace", "sliding_window", "num_hash_layers",
                           "index_skip_topk_offset")},
    **{k: _POSITIVE for k in ("rms_norm_eps", "layer_norm_epsilon", "norm_eps", "rope_theta", "hc_eps",
                              "routed_scaling_factor", "swiglu_limit", "compress_rope_theta")},
    "partial_rotary_factor": Rule("float", 0, 1, above=True),
    **{k: Rule("bool") for k in ("tie_word_embeddings", "norm_topk_prob", "attention_bias", "use_sliding_window",
                                 "use_qk_norm")},
}


def check_hf_values(hf: dict[str, Any], where: str = "config.json") -> None:
    """Every known scalar of an HF config (and of a nested `text_config` / `rope_parameters`)
    against `HF_VALUE_RULES` -> ConfigError naming the first bad key."""
    scopes = [("", hf)] + [(f"{k}.", hf[k]) for k in ("text_config", "rope_parameters", "rope_scaling")
                           if isinstance(hf.get(k), dict)]
    for prefix, scope in scopes:
        for key, rule in HF_VALUE_RULES.items():
            if key in scope:
                why = rule.why_not(scope[key])
                if why:
                    raise ConfigError(f"{where}: {prefix}{key} {why}, got {scope[key]!r}")


# The layer kinds a config may name (`ModelConfig.layer_kinds`); `models.layers` registers
# one class under each (and refuses a name not listed here).
LAYER_KINDS = ("attention", "sliding_attention", "gated_attention", "gated_deltanet", "mla", "mla_dsa",
               "mla_dsa_shared", "dsv4_sliding", "dsv4_hca", "dsv4_csa")

@dataclasses.dataclass(frozen=True)
class DeltaNetConfig:
    """Sizes of the Gated DeltaNet (linear attention) layers of hybrid models
    (`ftjax.models.deltanet`)."""

    num_k_heads: int  # Hk
    num_v_heads: int  # Hv (a multiple of Hk)
    k_head_dim: int  # dk
    v_head_dim: int  # dv
    conv_kernel: int  # K
    fused_qkvz: bool = False  # Qwen3-Next's grouped in_proj_qkvz / in_proj_ba (else Qwen3.5's split projections)


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Sizes of multi-head latent attention (DeepSeek-V2/V3, `ftjax.models.mla`)."""

    q_lora_rank: int | None  # Rq: rank of the query down-projection; None = a plain q_proj
    kv_lora_rank: int  # R: width of the cached latent c_kv
    qk_nope_head_dim: int  # dn: per-head query/key dims without RoPE
    qk_rope_head_dim: int  # dr: per-head query dims with RoPE (the key's are shared by all heads)
    v_head_dim: int  # dv
    rope_interleave: bool = True  # RoPE over interleaved pairs (x0, x1), (x2, x3), ... (else rotate-half)
    softmax_scale: float = 0.0  # scale of q·k; 0 = (dn + dr)^-1/2
    attention_bias: bool = False  # biases on q_a_proj, kv_a_proj_with_mqa and o_proj


@dataclasses.dataclass(frozen=True)
class DSAConfig:
    """Sizes of the DeepSeek sparse-attention indexer (GLM-5, `ftjax.models.dsa`): each query
    attends only the `index_topk` cached keys its lightning indexer scores highest."""

    index_n_heads: int  # Hi: indexer heads (one weight per head and query)
    index_head_dim: int  # di: indexer query/key width; its first dr dims carry RoPE
    index_topk: int  # k: keys kept per query


@dataclasses.dataclass(frozen=True)
class DSV4Config:
    """What only DeepSeek-V4 has (`ftjax.models.deepseek_v4`, `ftjax.models.dsv4_attention`):
    shared-KV attention with a query bottleneck, a grouped output projection and a sliding
    window, plus compressed KV entries (every `csa_rate` / `hca_rate` tokens pooled into
    one; the CSA ones filtered by a lightning indexer); hyper-connection residual streams;
    per-layer hash or score-top-k routing and clamped SwiGLU experts."""

    q_lora_rank: int  # Rq
    o_groups: int  # g: head groups of the grouped output projection
    o_lora_rank: int  # per-group width of the grouped output projection
    sliding_window: int  # keys within this many positions (the query included)
    csa_rate: int  # m: tokens per compressed entry in compressed_sparse_attention layers
    hca_rate: int  # m': tokens per compressed entry in heavily_compressed_attention layers
    rope_dim: int  # dr: trailing dims of each head that carry (interleaved) RoPE
    compress_rope_theta: float  # RoPE base of compressed layers (the sliding layers use rope_theta)
    compress_rope_scaling: RopeScaling | None  # YaRN of the compressed layers' RoPE (None: plain)
    hc_mult: int  # residual streams of the hyper-connections
    hc_sinkhorn_iters: int
    hc_eps: float
    index_n_heads: int  # Hi
    index_head_dim: int  # di
    index_topk: int  # compressed entries kept per query in CSA layers
    scoring_func: str  # router scores: "sqrtsoftplus" | "sigmoid"
    swiglu_limit: float | None  # clamp of SwiGLU pre-activations (None: none)
    hash_layers: tuple[bool, ...]  # per layer: routed by the token-id table (hash_moe)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN rotary scaling, the parameters transformers' `_compute_yarn_parameters` reads:
    frequencies interpolated by `factor` below the correction range [beta_slow, beta_fast]
    rotations over `original_max_position` tokens, extrapolated above it, blended linearly
    inside; cos and sin are multiplied by `attention_factor`."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a checkpoint's architecture."""

    model_type: str
    vocab_size: int
    d_model: int  # D
    num_layers: int  # L
    num_heads: int  # H
    num_kv_heads: int  # G
    head_dim: int
    d_ff: int  # F of dense MLP layers (0 when every layer is MoE)
    d_ff_expert: int  # F of one routed expert
    num_experts: int  # E
    top_k: int  # K
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]  # per layer: MoE block (True) or dense MLP (False)
    sliding_windows: tuple[int, ...]  # per layer: window size, 0 = full attention
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qk_norm: str = "none"  # "none" | "head" (per head, Qwen3) | "full" (whole width, OLMoE)
    qkv_bias: bool = False
    o_bias: bool = False
    clip_qkv: float | None = None
    shared_expert_d_ff: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False  # sigmoid-gated shared expert (Qwen2-MoE)
    tie_embeddings: bool = False
    max_position: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    layer_kinds: tuple[str, ...] = ()  # per layer: one of LAYER_KINDS; () = all "attention"
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): 1.0 for zero-centred norms (Qwen3-Next)
    rotary_dim: int = 0  # leading dims of each head RoPE rotates (partial rotary); 0 = head_dim
    deltanet: DeltaNetConfig | None = None  # linear-attention sizes of gated_deltanet layers
    router: str = "softmax"  # "softmax" (softmax, top-k) | "sigmoid_group" (DeepSeek-V3: biased, group-limited)
    # | "deepseek_v4" (per layer: a token-id hash table or biased top-k of sqrtsoftplus / sigmoid scores)
    n_group: int = 1  # sigmoid_group: experts form n_group equal groups ...
    topk_group: int = 1  # ... of which the topk_group best (sum of each group's top-2 biased scores) are eligible
    routed_scaling_factor: float = 1.0  # sigmoid_group: routed weights are multiplied by this
    rope_scaling: RopeScaling | None = None  # None = plain RoPE
    mla: MLAConfig | None = None  # latent-attention sizes of mla layers
    dsa: DSAConfig | None = None  # sparse-attention indexer sizes of mla_dsa layers
    dsv4: DSV4Config | None = None  # DeepSeek-V4's attention / hyper-connection / routing fields

    # ---- derived sizes ------------------------------------------------------------
    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Decoder-layer index of each MoE layer, in order (MoE layer m -> decoder layer)."""
        return tuple(i for i, is_moe in enumerate(self.moe_layers) if is_moe)

    @property
    def num_moe_layers(self) -> int:  # Lm
        return sum(self.moe_layers)

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def layer_kind(self, layer: int) -> str:
        """Name of layer `layer`'s token-mixing kind (see `ftjax.models.layers`). An
        `attention` layer whose sliding window is shorter than the context keeps only
        its window (`sliding_attention`)."""
        kind = self.layer_kinds[layer] if self.layer_kinds else "attention"
        if kind == "attention" and 0 < self.sliding_windows[layer] < self.max_position:
            return "sliding_attention"
        return kind

    def moe_index(self, layer: int) -> int:
        """Position of decoder layer `layer` among the MoE layers."""
        return self.moe_layer_ids.index(layer)


# The config.json keys behind ModelConfig fields that have no alias list above, for messages.
HF_NAMES: dict[str, tuple[str, ...]] = {
    "d_ff": ("intermediate_size",), "shared_expert_d_ff": ("shared_expert_intermediate_size",),
    "vocab_size": ("vocab_size",), "head_dim": ("head_dim",),
}


def hf_get(hf: dict[str, Any], field: str, default: Any = dataclasses.MISSING) -> Any:
    """Read `field` from an HF config dict through its known aliases."""
    for name in HF_ALIASES.get(field, (field,)):
        if hf.get(name) is not None:
            return hf[name]
    if default is dataclasses.MISSING:
        names = " / ".join(HF_ALIASES.get(field, (field,)))
        raise ConfigError(f"config.json has no {names}")
    return default


def rope_theta(hf: dict[str, Any]) -> float:
    """`rope_theta` sits at the top level (v4 configs) or inside `rope_parameters` (v5)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError(f"rope_type {rope_type!r} is not supported yet (only the default RoPE)")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    return float(theta if theta is not None else 10000.0)


def rope_params(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) of a family that supports YaRN: the default RoPE or
    `rope_type` / `type` "yarn" (v4 `rope_scaling` or v5 `rope_parameters`), read as
    transformers 5 reads them. Any other kind is a ConfigError naming it."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters must be a JSON object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", hf.get("rope_theta"))
    theta = float(theta if theta is not None else 10000.0)
    if rope_type in ("default", None):
        return theta, None
    if rope_type != "yarn":
        raise ConfigError(f"rope_type {rope_type!r} is not supported (only the default RoPE and 'yarn')")
    original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") \
        or hf_get(hf, "max_position")
    factor = params.get("factor")
    factor = float(factor) if factor is not None else hf_get(hf, "max_position") / original
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention = yarn_mscale(factor)
    return theta, RopeScaling(
        factor=factor, original_max_position=int(original), beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1), attention_factor=float(attention),
        truncate=bool(params.get("truncate", True)))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term 0.1·mscale·ln(scale) + 1 (1 when not scaled)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json in the model folder")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: must hold a JSON object, got {type(hf).__name__}")
    return hf


def validate(cfg: ModelConfig) -> ModelConfig:
    """Range checks on every field a family reader fills, beyond the ones tensor shapes
    enforce later: sizes positive, eps / theta finite, per-layer tuples of the right
    length, token ids in the vocabulary. Raises ConfigError naming the field."""
    def bad(field, why, where=cfg, what=""):
        names = HF_ALIASES.get(field, ()) + HF_NAMES.get(field, ())
        named = f"{field} ({' / '.join(names)})" if names and field not in names else field
        raise ConfigError(f"config.json: {what}{named} {why}, got {getattr(where, field)!r}")

    def sizes(where, fields, what=""):  # each a positive int that fits an int32
        for field in fields:
            value = getattr(where, field)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_SIZE:
                bad(field, f"must be an integer in 1..{MAX_SIZE}", where, what)

    sizes(cfg, ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts",
                "top_k", "max_position"))
    for field in ("d_ff", "d_ff_expert", "shared_expert_d_ff"):
        value = getattr(cfg, field)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SIZE:
            bad(field, f"must be an integer in 0..{MAX_SIZE}")
    if cfg.top_k > cfg.num_experts:
        bad("top_k", f"(num_experts_per_tok) must be at most num_experts ({cfg.num_experts})")
    if cfg.num_heads % cfg.num_kv_heads:
        bad("num_heads", f"must be a multiple of num_kv_heads ({cfg.num_kv_heads})")
    if not (math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0):
        bad("rope_theta", "must be finite and positive")
    if not (math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps >= 0):
        bad("rms_norm_eps", "must be finite and non-negative")
    if cfg.clip_qkv is not None and not (math.isfinite(cfg.clip_qkv) and cfg.clip_qkv > 0):
        bad("clip_qkv", "must be finite and positive (or null)")
    if len(cfg.moe_layers) != cfg.num_layers:
        bad("moe_layers", f"must have one entry per layer ({cfg.num_layers})")
    if len(cfg.sliding_windows) != cfg.num_layers or any(
            isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in cfg.sliding_windows):
        bad("sliding_windows", f"must be {cfg.num_layers} non-negative integers")
    if any(cfg.moe_layers) and cfg.d_ff_expert <= 0:
        bad("d_ff_expert", "must be positive when a layer is MoE")
    if not all(cfg.moe_layers) and cfg.d_ff <= 0:
        bad("d_ff", "(intermediate_size) must be positive when a layer is dense")
    token = lambda t: not isinstance(t, bool) and isinstance(t, int) and t >= 0  # noqa: E731
    if cfg.bos_token_id is not None and not token(cfg.bos_token_id):
        bad("bos_token_id", "must be null or a non-negative token id")
    if not all(token(t) for t in cfg.eos_token_ids):
        bad("eos_token_ids", "(eos_token_id) must be non-negative token ids")
    if cfg.layer_kinds and (len(cfg.layer_kinds) != cfg.num_layers or not set(cfg.layer_kinds) <= set(LAYER_KINDS)):
        bad("layer_kinds", f"must be {cfg.num_layers} names from {sorted(LAYER_KINDS)}")
    if isinstance(cfg.rotary_dim, bool) or not isinstance(cfg.rotary_dim, int) or not (
            0 <= cfg.rotary_dim <= cfg.head_dim and cfg.rotary_dim % 2 == 0):
        bad("rotary_dim", f"(head_dim x partial_rotary_factor) must be an even integer in 0..head_dim ({cfg.head_dim})")
    check_router(cfg, bad)
    check_rope_scaling(cfg, bad)
    if "mla" in cfg.layer_kinds and cfg.mla is None:
        bad("mla", "(kv_lora_rank, qk_*_head_dim, v_head_dim) must be given when a layer is latent attention")
    if cfg.mla is not None:
        sizes(cfg.mla, ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"), "latent attention ")
        if cfg.mla.q_lora_rank is not None:
            sizes(cfg.mla, ("q_lora_rank",), "latent attention ")
        if cfg.mla.qk_rope_head_dim % 2:
            bad("qk_rope_head_dim", "must be even for RoPE", cfg.mla)
        if not (math.isfinite(cfg.mla.softmax_scale) and cfg.mla.softmax_scale >= 0):
            bad("softmax_scale", "must be finite and non-negative", cfg.mla)
    check_dsa(cfg, bad, sizes)
    check_dsv4(cfg, bad, sizes)
    dn = cfg.deltanet
    if "gated_deltanet" in cfg.layer_kinds and dn is None:
        bad("deltanet", "(linear_* sizes) must be given when a layer is linear_attention")
    if dn is not None:
        sizes(dn, ("num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim", "conv_kernel"), "linear attention ")
        if dn.num_v_heads % dn.num_k_heads:
            raise ConfigError(f"config.json: linear_num_value_heads {dn.num_v_heads} is not a multiple of "
                              f"linear_num_key_heads {dn.num_k_heads}")
    return cfg


def check_dsa(cfg: ModelConfig, bad, sizes) -> None:
    """An mla_dsa layer needs the indexer sizes, a query down-projection (the indexer's
    queries come from its latent) and room for the RoPE dims in the indexer head."""
    if "mla_dsa" in cfg.layer_kinds and (cfg.dsa is None or cfg.mla is None):
        bad("dsa", "(index_n_heads, index_head_dim, index_topk) must be given when a layer is sparse attention")
    if cfg.dsa is None:
        return
    sizes(cfg.dsa, ("index_n_heads", "index_head_dim", "index_topk"), "sparse attention ")
    if cfg.mla is not None and cfg.mla.q_lora_rank is None:
        bad("q_lora_rank", "must be given for sparse attention (the indexer reads the query latent)", cfg.mla)
    if cfg.mla is not None and cfg.dsa.index_head_dim < cfg.mla.qk_rope_head_dim:
        bad("index_head_dim", f"must be at least qk_rope_head_dim ({cfg.mla.qk_rope_head_dim})", cfg.dsa)


def check_dsv4(cfg: ModelConfig, bad, sizes) -> None:
    """DeepSeek-V4 layer kinds need their fields; the sizes must divide as the layers use them."""
    if any(k.startswith("dsv4_") for k in cfg.layer_kinds) and cfg.dsv4 is None:
        bad("dsv4", "(DeepSeek-V4 attention fields) must be given when a layer is a dsv4_* kind")
    v = cfg.dsv4
    if v is None:
        return
    sizes(v, ("q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "csa_rate", "hca_rate", "rope_dim",
              "hc_mult", "hc_sinkhorn_iters", "index_n_heads", "index_head_dim", "index_topk"), "deepseek_v4 ")
    if (cfg.num_heads * cfg.head_dim) % v.o_groups:
        bad("o_groups", f"must divide num_attention_heads x head_dim ({cfg.num_heads * cfg.head_dim})", v)
    if v.rope_dim % 2 or v.rope_dim > min(cfg.head_dim, v.index_head_dim):
        bad("rope_dim", f"(head_dim x partial_rotary_factor) must be even and at most head_dim ({cfg.head_dim}) "
                        f"and index_head_dim ({v.index_head_dim})", v)
    if len(v.hash_layers) != cfg.num_layers:
        bad("hash_layers", f"must have one entry per layer ({cfg.num_layers})", v)


ROUTERS = ("softmax", "sigmoid_group", "deepseek_v4")


def check_router(cfg: ModelConfig, bad) -> None:
    """The router kind and, for sigmoid_group, a group layout every token can route in:
    equal groups of at least two experts (a group scores by its top two), at least
    top_k experts in the kept groups."""
    if cfg.router not in ROUTERS:
        bad("router", f"must be one of {ROUTERS}")
    if cfg.router != "sigmoid_group":
        return
    for field in ("n_group", "topk_group"):
        value = getattr(cfg, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            bad(field, "must be a positive integer")
    if cfg.num_experts % cfg.n_group or cfg.num_experts // cfg.n_group < 2:
        bad("n_group", f"must split num_experts ({cfg.num_experts}) into equal groups of at least 2")
    if cfg.topk_group > cfg.n_group:
        bad("topk_group", f"must be at most n_group ({cfg.n_group})")
    if cfg.top_k > cfg.topk_group * (cfg.num_experts // cfg.n_group):
        bad("top_k", f"(num_experts_per_tok) must be at most the experts of topk_group groups "
                     f"({cfg.topk_group * (cfg.num_experts // cfg.n_group)})")
    if not (math.isfinite(cfg.routed_scaling_factor) and cfg.routed_scaling_factor > 0):
        bad("routed_scaling_factor", "must be finite and positive")


def check_rope_scaling(cfg: ModelConfig, bad) -> None:
    y = cfg.rope_scaling
    if y is None:
        return
    for field in ("factor", "beta_fast", "beta_slow", "attention_factor"):
        value = getattr(y, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            bad(field, "must be finite and positive", y, "rope_scaling ")
    if isinstance(y.original_max_position, bool) or not isinstance(y.original_max_position, int) or not (
            0 < y.original_max_position <= MAX_SIZE):
        bad("original_max_position", f"must be an integer in 1..{MAX_SIZE}", y, "rope_scaling ")
