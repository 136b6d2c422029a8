"""GLM-5 / GLM-5.1 / GLM-5.2 (GlmMoeDsaForCausalLM, model_type `glm_moe_dsa`): DeepSeek
sparse attention on every layer (`ftjax.models.dsa`: multi-head latent attention whose queries
attend only the index_topk keys a lightning indexer selects; latent and indexer key
caches), the first `first_k_dense_replace` layers dense (or as `mlp_layer_types` says),
the rest routed experts plus ungated shared experts routed `sigmoid_group`, as
DeepSeek-V3. RoPE over qk_rope_head_dim dims, always interleaved pairs (transformers
ignores `rope_interleave` here), default or YaRN (mscale_all_dim scales the softmax).

Checkpoints name the shared experts `mlp.shared_experts.*` and store the
multi-token-prediction layer after the last decoder layer (skipped); the indexer's
tensors are `self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`.

IndexShare (GLM-5.2: `indexer_types` / `index_topk_pattern` / `index_topk_freq` with
"shared" layers): a shared layer has no indexer and reuses the top-k selection of the
last full layer before it (`dsa.SharedSparseLatentAttention`). The selection passes
between layers within one forward trace, so such a model has no streamed prefill (one
layer per program); `prefill="auto"` then prefills with the cached experts.
"""

from ftjax.config import ConfigError, DSAConfig, MLAConfig, ModelConfig
from ftjax.models import dsa  # noqa: F401  (registers the mla_dsa and mla_dsa_shared layer kinds)
from ftjax.models.deepseek_v3 import mla_head_dims, softmax_scale
from ftjax.models.hf import base_fields, check, deepseek_moe_fields, mtp_ignored_keys

KEY_ALIASES = [(r"\.mlp\.shared_experts\.", ".mlp.shared_expert.")]

ignored_keys = mtp_ignored_keys


def indexer_types(hf: dict, num_layers: int) -> list[str]:
    """Per-layer indexer mode as transformers' GlmMoeDsaConfig derives it: `indexer_types`,
    else `index_topk_pattern` ("F" full / "S" shared), else every `index_topk_freq`-th
    layer from `index_skip_topk_offset` full (default: every layer)."""
    types = hf.get("indexer_types")
    if types is None and hf.get("index_topk_pattern") is not None:
        pattern = hf["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        freq = max(int(hf.get("index_topk_freq") or 1), 1)
        offset = int(hf.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"indexer_types must list {num_layers} layer modes, got {types!r}")
    return types


def moe_layers(hf: dict, num_layers: int, dense_first: tuple[bool, ...]) -> tuple[bool, ...]:
    """`mlp_layer_types` ("dense" / "sparse" per layer) when given, else the
    first_k_dense_replace split."""
    types = hf.get("mlp_layer_types")
    if types is None:
        return dense_first
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {"dense", "sparse"}:
        raise ConfigError(f"mlp_layer_types must list {num_layers} of 'dense' / 'sparse', got {types!r}")
    return tuple(t == "sparse" for t in types)


def config_from_hf(hf: dict) -> ModelConfig:
    f = base_fields(hf, yarn=True)
    L = f["num_layers"]
    types = indexer_types(hf, L)
    unknown = sorted({t for t in types if t not in ("full", "shared")})
    if unknown:
        raise ConfigError(f"indexer_types {unknown} are not supported (known: 'full', 'shared')")
    if types[0] != "full":
        raise ConfigError("indexer_types: the first layer must be 'full' (a 'shared' layer reuses the top-k of the "
                          "'full' layer before it)")
    if hf.get("q_lora_rank") is None:
        raise ConfigError("q_lora_rank must be given for glm_moe_dsa (the indexer reads the query latent)")
    nope, rope = mla_head_dims(hf, f, "glm_moe_dsa")
    scaling = f["rope_scaling"]
    moe = deepseek_moe_fields(hf, L)
    moe["moe_layers"] = moe_layers(hf, L, moe["moe_layers"])
    return check(ModelConfig(
        **f,
        **moe,
        layer_kinds=tuple("mla_dsa" if t == "full" else "mla_dsa_shared" for t in types),
        rotary_dim=rope,
        mla=MLAConfig(
            q_lora_rank=int(hf["q_lora_rank"]),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=int(hf["v_head_dim"]),
            rope_interleave=True,
            softmax_scale=softmax_scale(hf, nope + rope, scaling.factor if scaling else None),
            attention_bias=bool(hf.get("attention_bias", False)),
        ),
        dsa=DSAConfig(
            index_n_heads=int(hf.get("index_n_heads", 32)),
            index_head_dim=int(hf.get("index_head_dim", 128)),
            index_topk=int(hf.get("index_topk", 2048)),
        ),
    ))


def streamed_prefill(cfg: ModelConfig) -> bool:
    """One layer per program is possible unless a layer shares another's selection."""
    return "mla_dsa_shared" not in cfg.layer_kinds
