"""DeepSeek-V3 / V3.1 / R1 (DeepseekV3ForCausalLM): multi-head latent attention on every
layer (`ftjax.models.mla`: a latent KV cache, absorbed projections for decode); the first
`first_k_dense_replace` layers dense, the rest routed experts plus ungated shared experts,
routed `sigmoid_group` (sigmoid scores, e_score_correction_bias, n_group / topk_group,
routed_scaling_factor). RoPE (qk_rope_head_dim dims, interleaved pairs when
`rope_interleave`) default or YaRN; YaRN's mscale_all_dim also scales the softmax
(mscale² on (dn + dr)^-1/2), as transformers computes it.

Checkpoints name the shared experts `mlp.shared_experts.*` (aliased to the canonical
`mlp.shared_expert.*`) and store the multi-token-prediction layer after the last decoder
layer (skipped). FP8 checkpoints (`quantization_config` fp8, 128x128 block scales) load
through the checkpoint reader: experts kept as stored (`fp8_e4m3`), dense FP8 matrices
dequantised at load (`ftjax.checkpoint`); other quantisation configs are refused.
"""

from ftjax.config import ConfigError, MLAConfig, ModelConfig, yarn_mscale
from ftjax.models import mla  # noqa: F401  (registers the mla layer kind)
from ftjax.models.hf import base_fields, check, deepseek_moe_fields, mtp_ignored_keys

KEY_ALIASES = [(r"\.mlp\.shared_experts\.", ".mlp.shared_expert.")]

ignored_keys = mtp_ignored_keys


def softmax_scale(hf: dict, qk_head_dim: int, factor: float | None) -> float:
    """(dn + dr)^-1/2, times yarn_mscale(factor, mscale_all_dim)² under YaRN (transformers'
    `yarn_apply_mscale`)."""
    scale = qk_head_dim ** -0.5
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if factor is not None and mscale_all_dim:
        scale *= yarn_mscale(factor, mscale_all_dim) ** 2
    return scale


def mla_head_dims(hf: dict, fields: dict, family: str) -> tuple[int, int]:
    """(qk_nope_head_dim, qk_rope_head_dim) of an MLA config; sets the per-head q/k width
    and kv heads (MLA has none) in `fields`. RoPE must cover exactly the rope dims."""
    nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    partial = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"partial_rotary_factor {partial!r} is not supported for {family} "
                          "(RoPE covers qk_rope_head_dim)")
    fields.update(head_dim=nope + rope, num_kv_heads=fields["num_heads"])
    return nope, rope


def config_from_hf(hf: dict) -> ModelConfig:
    f = base_fields(hf, yarn=True)
    q_lora = hf.get("q_lora_rank")
    nope, rope = mla_head_dims(hf, f, "deepseek_v3")
    scaling = f["rope_scaling"]
    return check(ModelConfig(
        **f,
        **deepseek_moe_fields(hf, f["num_layers"]),
        layer_kinds=("mla",) * f["num_layers"],
        rotary_dim=rope,
        mla=MLAConfig(
            q_lora_rank=int(q_lora) if q_lora is not None else None,
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=int(hf["v_head_dim"]),
            rope_interleave=bool(hf.get("rope_interleave", True)),
            softmax_scale=softmax_scale(hf, nope + rope, scaling.factor if scaling else None),
            attention_bias=bool(hf.get("attention_bias", False)),
        ),
    ))
