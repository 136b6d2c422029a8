"""DeepSeek-V4 (DeepseekV4ForCausalLM, model_type `deepseek_v4`; V4-Flash / V4-Pro):
transformers 5's `modeling_deepseek_v4` is the reference.

What differs from the shared decoder, and where it lives:
- Attention: three layer kinds (`ftjax.models.dsv4_attention`) picked per layer from
  `layer_types`: sliding_attention -> dsv4_sliding, heavily_compressed_attention ->
  dsv4_hca, compressed_sparse_attention -> dsv4_csa (legacy `compress_ratios` 0 / 4 / 128
  map the same way). Shared-KV MQA with a sink, a grouped output projection, partial
  interleaved RoPE (the "main" base for sliding layers, the "compress" base and YaRN for
  compressed ones).
- Hyper-connections (mHC): the residual is hc_mult streams [B, T, hc, D]; before each
  block a learned map (`HyperConnection`: a linear map of the RMS-normalised streams,
  sigmoid "pre" / "post" weights and a Sinkhorn-normalised "comb" matrix) collapses
  them into the block input, and expands the block output back, mixed with the
  streams; `HyperHead` collapses them before the final norm. Stateless per token.
- Routing is per layer and per family data (`route_scores`, `route_top_k`,
  `route_hash`), all ending in the executor's (ids [N, K] int32, weights [N, K]):
  scores = scoring_func(x W_gate) ("sqrtsoftplus" = sqrt(softplus), or "sigmoid"); a
  `moe` layer selects the top K of scores + e_score_correction_bias, a `hash_moe` layer
  the K experts its frozen table `tid2eid[token]` names (so the decoder hands the token
  ids to the MoE block); weights = the selected scores, normalised to sum 1 (always:
  transformers ignores `norm_topk_prob` here), times routed_scaling_factor. Hash-routed
  experts are ordinary experts of the pool and the cache.
- Clamped SwiGLU: gate <= swiglu_limit, |up| <= swiglu_limit, in the shared expert
  (`ClampedMLP`) and in the routed ones (the executor's `swiglu_limit` on the device, the
  C++ expert kernel's on the host: every pool format, every policy).
Every layer is MoE (one ungated shared expert of moe_intermediate_size).

This family has its own decoder (`DeepseekV4CausalLM`, registered in
`common.MODEL_CLASSES`), because hyper-connections change the residual stream and hash
routing needs the token ids at the MoE layer. The streamed prefill (one program per
layer) cannot pass either, so it is off for this family (`streamed_prefill`).

Checkpoints: the original DeepSeek names (`layers.{i}.attn.wq_a`, `ffn.experts.{e}.w1`,
`hc_attn_fn`, `embed`, `head`, ... with or without the `model.` prefix; what transformers'
save_pretrained writes) and transformers' module names are both read. The
multi-token-prediction module (`mtp.*`, num_nextn_predict_layers) is not used.

Refused (ConfigError naming the value): another scoring_func ("softmax" is not in
transformers' activation table either), a layer type outside the three, an mlp layer
type other than hash_moe / moe, n_shared_experts != 1, hidden_act other than silu, a
RoPE type other than default / yarn, quantised (FP8 / FP4) checkpoints.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ftjax.config import ConfigError, DSV4Config, ModelConfig, hf_get, rope_params
from ftjax.models import dsv4_attention  # noqa: F401  (registers the dsv4_* layer kinds)
from ftjax.models.common import MODEL_CLASSES, CausalLM, ExpertCall, Step
from ftjax.models.hf import base_fields, check
from ftjax.models.layers import kind_class
from ftjax.models.ops import RMSNorm, linear, linear_param, param

LAYER_KINDS = {"sliding_attention": "dsv4_sliding", "heavily_compressed_attention": "dsv4_hca",
               "compressed_sparse_attention": "dsv4_csa"}
LEGACY_RATIOS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
def streamed_prefill(cfg: ModelConfig) -> bool:
    """Never for this family: see the module docstring."""
    return False

# Original DeepSeek-V4 names -> transformers' names (then `checkpoint.CANONICAL`), in order.
KEY_ALIASES = [
    (r"^layers\.", "model.layers."),
    (r"^(model\.)?embed\.weight$", "model.embed_tokens.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^(model\.)?head\.weight$", "lm_head.weight"),
    (r"^(model\.)?hc_head_(fn|base|scale)$", r"model.hc_head.hc_\2"),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.self_attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.self_attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.self_attn\.((compressor\.)?(indexer\.)?)norm\.", r".self_attn.\1kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.(shared_experts|experts\.\d+)\.w1\.", r".\1.gate_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w2\.", r".\1.down_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w3\.", r".\1.up_proj."),
    (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
]

IGNORED_KEYS = [(re.compile(r"(model\.)?mtp\..*"), "the multi-token-prediction module (speculative decoding) is not used")]

# Tensors real bf16 checkpoints keep in float32 (transformers' _keep_in_fp32_modules_strict):
# they do not make the checkpoint a float32 one.
KEPT_F32 = [re.compile(r"model\.(hc_head\..*|norm\.weight)"),
            re.compile(r"model\.layers\.\d+\.((attn|ffn)_hc\..*|input_layernorm\..*|post_attention_layernorm\..*|"
                       r"self_attn\.(sinks|q_a_norm\..*|kv_norm\..*|compressor\.(indexer\.)?(position_bias|kv_norm\..*))|"
                       r"mlp\.gate\.(e_score_correction_bias|tid2eid))")]


# ---- config ------------------------------------------------------------------------------------

def layer_types(hf: dict, L: int) -> list[str]:
    """Per-layer attention type: `layer_types`, else the legacy `compress_ratios`, else
    transformers' default (two HCA layers, then CSA / HCA alternating)."""
    types = hf.get("layer_types")
    if types is None and hf.get("compress_ratios") is not None:
        ratios = hf["compress_ratios"]
        bad = [r for r in ratios if r not in LEGACY_RATIOS]
        if bad:
            raise ConfigError(f"compress_ratios {bad} are not supported (known: {sorted(LEGACY_RATIOS)})")
        types = [LEGACY_RATIOS[r] for r in ratios]
    if types is None:
        types = ["heavily_compressed_attention"] * min(L, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(L - 2, 0))]
    types = list(types)[:L]
    if len(types) != L:
        raise ConfigError(f"layer_types must list {L} attention types, got {types!r}")
    unknown = sorted({str(t) for t in types} - set(LAYER_KINDS))
    if unknown:
        raise ConfigError(f"layer_types {unknown} are not supported (known: {', '.join(LAYER_KINDS)})")
    return types


def mlp_layer_types(hf: dict, L: int) -> list[str]:
    """Per-layer routing: `mlp_layer_types`, else the first `num_hash_layers` (3) hash_moe."""
    types = hf.get("mlp_layer_types")
    if types is None:
        n_hash = int(hf.get("num_hash_layers", 3))
        types = ["hash_moe"] * min(L, n_hash) + ["moe"] * max(0, L - n_hash)
    types = list(types)[:L]
    if len(types) != L or not set(types) <= {"hash_moe", "moe"}:
        raise ConfigError(f"mlp_layer_types must list {L} of 'hash_moe' / 'moe', got {types!r}")
    return types


def compress_rope(hf: dict) -> tuple[float, Any]:
    """(theta, YaRN or None) of the compressed layers' RoPE, as transformers' config builds
    `rope_parameters["compress"]`: compress_rope_theta, and any YaRN parameters given at the
    top level of rope_parameters / rope_scaling, with attention_factor 1 unless given."""
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ConfigError(f"rope_parameters must be a JSON object, got {rp!r}")
    main = rp.get("main")
    if isinstance(main, dict) and main.get("rope_type", main.get("type", "default")) != "default":
        raise ConfigError(f"rope_parameters.main rope_type {main.get('rope_type')!r} is not supported (only 'default')")
    compress = rp.get("compress") if isinstance(rp.get("compress"), dict) else {
        **{k: v for k, v in rp.items() if k not in ("main", "compress")},
        "rope_theta": hf.get("compress_rope_theta", 160000.0)}
    compress = dict(compress)
    if compress.get("rope_type", compress.get("type")) == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return rope_params({"rope_parameters": compress, "max_position_embeddings": hf_get(hf, "max_position", 4096)})


def config_from_hf(hf: dict) -> ModelConfig:
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ConfigError(f"quantization_config {method!r} is not supported (use a bf16 / fp32 checkpoint)")
    scoring = hf.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING_FUNCS:
        raise ConfigError(f"scoring_func {scoring!r} is not supported for deepseek_v4 (only {', '.join(SCORING_FUNCS)})")
    if int(hf.get("n_shared_experts", 1) or 0) != 1:
        raise ConfigError(f"n_shared_experts {hf['n_shared_experts']!r} is not supported for deepseek_v4 "
                          "(transformers builds one shared expert of moe_intermediate_size)")
    if hf.get("mlp_bias") or hf.get("attention_bias"):
        raise ConfigError("mlp_bias / attention_bias are not supported for deepseek_v4 (its layers have no biases)")
    f = base_fields({**hf, "rope_parameters": None, "rope_scaling": None})  # the two RoPEs are read here
    main = (hf.get("rope_parameters") or {}).get("main") if isinstance(hf.get("rope_parameters"), dict) else None
    if isinstance(main, dict) and main.get("rope_theta") is not None:
        f["rope_theta"] = float(main["rope_theta"])
    L, hd = f["num_layers"], f["head_dim"]
    partial = hf.get("partial_rotary_factor")
    rope_dim = int(hd * partial) if partial is not None else int(hf.get("qk_rope_head_dim", hd * 64 // 512))
    theta, scaling = compress_rope(hf)
    types = layer_types(hf, L)
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(hf.get("compress_rates") or {})}
    for legacy, key in (("compress_rate_csa", "compressed_sparse_attention"),
                        ("compress_rate_hca", "heavily_compressed_attention")):
        if hf.get(legacy) is not None:
            rates[key] = hf[legacy]
    limit = hf.get("swiglu_limit", 10.0)
    return check(ModelConfig(
        **{**f, "num_kv_heads": f["num_heads"]},  # one shared KV head, broadcast to every query head
        d_ff=0,
        d_ff_expert=int(hf["moe_intermediate_size"]),
        norm_topk_prob=True,
        moe_layers=(True,) * L,
        sliding_windows=(int(hf.get("sliding_window", 128)),) * L,
        shared_expert_d_ff=int(hf["moe_intermediate_size"]),
        router="deepseek_v4",
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.5)),
        layer_kinds=tuple(LAYER_KINDS[t] for t in types),
        rotary_dim=rope_dim,
        dsv4=DSV4Config(
            q_lora_rank=int(hf["q_lora_rank"]),
            o_groups=int(hf.get("o_groups", 8)),
            o_lora_rank=int(hf.get("o_lora_rank", 1024)),
            sliding_window=int(hf.get("sliding_window", 128)),
            csa_rate=int(rates["compressed_sparse_attention"]),
            hca_rate=int(rates["heavily_compressed_attention"]),
            rope_dim=rope_dim,
            compress_rope_theta=theta,
            compress_rope_scaling=scaling,
            hc_mult=int(hf.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(hf.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(hf.get("hc_eps", 1e-6)),
            index_n_heads=int(hf.get("index_n_heads", 64)),
            index_head_dim=int(hf.get("index_head_dim", 128)),
            index_topk=int(hf.get("index_topk", 512)),
            scoring_func=scoring,
            swiglu_limit=float(limit) if limit is not None else None,
            hash_layers=tuple(t == "hash_moe" for t in mlp_layer_types(hf, L)),
        ),
    ))


# ---- routing (per-family data: every function ends in the executor's ids / weights) -----------

def route_scores(logits: jax.Array, scoring_func: str) -> jax.Array:
    """Router scores [N, E] f32: sqrt(softplus(logits)) or sigmoid(logits)."""
    logits = logits.astype(jnp.float32)
    if scoring_func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    return jax.nn.sigmoid(logits)


def routed_weights(scores: jax.Array, ids: jax.Array, scale: float) -> jax.Array:
    """The selected scores, normalised to sum 1, times `scale` -> [N, K] f32."""
    w = jnp.take_along_axis(scores, ids, axis=1)
    return w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20) * scale


def route_top_k(scores: jax.Array, bias: jax.Array, top_k: int, scale: float) -> tuple[jax.Array, jax.Array]:
    """`moe` layers: the top K of scores + bias (e_score_correction_bias [E]) ->
    ids [N, K] int32, weights [N, K] from the unbiased scores."""
    _, ids = jax.lax.top_k(scores + bias.astype(jnp.float32), top_k)
    return ids.astype(jnp.int32), routed_weights(scores, ids, scale)


def route_hash(scores: jax.Array, table: jax.Array, tokens: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
    """`hash_moe` layers: the K experts tid2eid [V, K] names for each token (tokens [N])."""
    ids = table[tokens].astype(jnp.int32)  # [N, K]
    return ids, routed_weights(scores, ids, scale)


# ---- blocks ------------------------------------------------------------------------------------

def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float | None) -> jax.Array:
    if limit is not None:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


class ClampedMLP(nnx.Module):
    """The shared expert: SwiGLU with clamped pre-activations (checkpoint names
    `mlp.shared_experts.{gate,up,down}_proj`, aliased to `mlp.shared_expert.*`)."""

    def __init__(self, d_model: int, d_ff: int, limit: float | None, dtype=jnp.float32, packed: bool = False):
        self.w_gate, self.w_up = linear_param(d_model, d_ff, dtype, packed), linear_param(d_model, d_ff, dtype, packed)
        self.w_down = linear_param(d_ff, d_model, dtype, packed)
        self.limit = limit

    def __call__(self, x: jax.Array) -> jax.Array:
        h = clamped_swiglu(linear(x, self.w_gate[...]), linear(x, self.w_up[...]), self.limit)
        return linear(h.astype(x.dtype), self.w_down[...])


class MoE(nnx.Module):
    """Router (hash table or biased top-k) + shared expert; routed experts in the executor."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype=jnp.float32, packed: bool = False):
        self.cfg, self.moe_index = cfg, cfg.moe_index(layer)
        self.is_hash = cfg.dsv4.hash_layers[layer]
        self.w_router = linear_param(cfg.d_model, cfg.num_experts, dtype, packed)
        if self.is_hash:
            self.tid2eid = param((cfg.vocab_size, cfg.top_k), jnp.float32)  # [V, K] expert ids (exact in f32)
        else:
            self.router_bias = nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32))
        self.shared = ClampedMLP(cfg.d_model, cfg.shared_expert_d_ff, cfg.dsv4.swiglu_limit, dtype, packed)

    def route(self, flat: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """flat [N, D], tokens [N] -> ids [N, K] int32, weights [N, K] f32."""
        cfg = self.cfg
        scores = route_scores(linear(flat, self.w_router[...]), cfg.dsv4.scoring_func)
        if self.is_hash:
            return route_hash(scores, self.tid2eid[...], tokens, cfg.routed_scaling_factor)
        return route_top_k(scores, self.router_bias[...], cfg.top_k, cfg.routed_scaling_factor)

    def __call__(self, x: jax.Array, tokens: jax.Array, valid: jax.Array, experts: ExpertCall, expert_state):
        """x [B, T, D], tokens [B, T], valid [B, T] -> [B, T, D]."""
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        ids, weights = self.route(flat, tokens.reshape(-1))
        y, expert_state = experts(self.moe_index, flat, ids, weights.astype(flat.dtype), valid.reshape(-1),
                                  expert_state)
        return (y + self.shared(flat)).reshape(B, T, D), expert_state


class HyperConnection(nnx.Module):
    """mHC weights from the hc streams (checkpoint names `{attn,ffn}_hc.{fn, base, scale}`)."""

    def __init__(self, cfg: ModelConfig):
        hc = cfg.dsv4.hc_mult
        self.cfg = cfg
        self.fn = param(((2 + hc) * hc, hc * cfg.d_model), jnp.float32)  # [(2+hc)·hc, hc·D] (HF layout)
        self.base = param(((2 + hc) * hc,), jnp.float32)
        self.scale = param((3,), jnp.float32)

    def __call__(self, streams: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """streams [B, T, hc, D] -> post [B, T, hc], comb [B, T, hc, hc] (doubly stochastic
        after Sinkhorn), the collapsed block input [B, T, D]."""
        v = self.cfg.dsv4
        hc, eps = v.hc_mult, v.hc_eps
        B, T = streams.shape[:2]
        flat = streams.reshape(B, T, -1).astype(jnp.float32)
        flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + self.cfg.rms_norm_eps)
        mix = flat @ self.fn[...].astype(jnp.float32).T  # [B, T, (2+hc)·hc]
        base, scale = self.base[...].astype(jnp.float32), self.scale[...].astype(jnp.float32)
        pre = jax.nn.sigmoid(mix[..., :hc] * scale[0] + base[:hc]) + eps
        post = 2 * jax.nn.sigmoid(mix[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
        comb = mix[..., 2 * hc:].reshape(B, T, hc, hc) * scale[2] + base[2 * hc:].reshape(hc, hc)
        comb = jax.nn.softmax(comb, axis=-1) + eps
        comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

        def sinkhorn(_, c):  # rows, then columns, to sum 1
            c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
            return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

        comb = jax.lax.fori_loop(0, v.hc_sinkhorn_iters - 1, sinkhorn, comb)
        collapsed = jnp.sum(pre[..., None] * streams, axis=2).astype(streams.dtype)
        return post, comb, collapsed


def expand(post: jax.Array, comb: jax.Array, out: jax.Array, streams: jax.Array) -> jax.Array:
    """New streams [B, T, hc, D]: post_k · out + Σ_j comb[j, k] · streams_j."""
    return (post[..., None] * out[..., None, :] + jnp.einsum("btjk,btjd->btkd", comb, streams)).astype(streams.dtype)


class HyperHead(nnx.Module):
    """The final collapse of the streams (`hc_head.{hc_fn, hc_base, hc_scale}`)."""

    def __init__(self, cfg: ModelConfig):
        hc = cfg.dsv4.hc_mult
        self.cfg = cfg
        self.hc_fn = param((hc, hc * cfg.d_model), jnp.float32)
        self.hc_base = param((hc,), jnp.float32)
        self.hc_scale = param((1,), jnp.float32)

    def __call__(self, streams: jax.Array) -> jax.Array:
        """streams [B, T, hc, D] -> [B, T, D]."""
        B, T = streams.shape[:2]
        flat = streams.reshape(B, T, -1).astype(jnp.float32)
        flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + self.cfg.rms_norm_eps)
        mix = flat @ self.hc_fn[...].astype(jnp.float32).T  # [B, T, hc]
        pre = jax.nn.sigmoid(mix * self.hc_scale[...].astype(jnp.float32) + self.hc_base[...]) + self.cfg.dsv4.hc_eps
        return jnp.sum(pre[..., None] * streams, axis=2).astype(streams.dtype)


class DecoderLayer(nnx.Module):
    """mHC collapse -> norm -> attention kind -> mHC expand; the same around the MoE."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype=jnp.float32, packed: bool = False):
        self.layer = layer
        self.attn_hc, self.ffn_hc = HyperConnection(cfg), HyperConnection(cfg)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, dtype)
        self.attn = kind_class(cfg.layer_kind(layer))(cfg, layer, dtype, packed)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, dtype)
        self.moe = MoE(cfg, layer, dtype, packed)

    def __call__(self, streams, tokens, step: Step, state, experts: ExpertCall, expert_state):
        """streams [B, T, hc, D], tokens [B, T] -> streams, state, expert_state."""
        post, comb, h = self.attn_hc(streams)
        h, state = self.attn(self.attn_norm(h), step, state)
        streams = expand(post, comb, h, streams)
        post, comb, h = self.ffn_hc(streams)
        h, expert_state = self.moe(self.mlp_norm(h), tokens, step.valid, experts, expert_state)
        return expand(post, comb, h, streams), state, expert_state


class DeepseekV4CausalLM(CausalLM):
    """Embedding -> hc streams -> L decoder layers -> HyperHead -> norm -> LM head."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, packed: bool = False):
        self.cfg = cfg
        self.embed = param((cfg.vocab_size, cfg.d_model), jnp.uint16 if packed else dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, packed) for i in range(cfg.num_layers)])
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, dtype)
        if not cfg.tie_embeddings:
            self.lm_head = linear_param(cfg.d_model, cfg.vocab_size, dtype, packed)

    def __call__(self, tokens, start, valid, state, experts: ExpertCall, expert_state, logits_at=None):
        """As `CausalLM.__call__`: tokens [B, T] from start [B] -> logits, state, expert_state."""
        B, T = tokens.shape
        step = self.step(start, valid)
        x = self.embed_tokens(tokens)  # [B, T, D]
        streams = jnp.broadcast_to(x[:, :, None, :], (B, T, self.cfg.dsv4.hc_mult, x.shape[-1]))
        new_state = []
        for layer, layer_state in zip(self.layers, state):
            streams, layer_state, expert_state = layer(streams, tokens, step, layer_state, experts, expert_state)
            new_state.append(layer_state)
        return self.head(streams, logits_at), tuple(new_state), expert_state

    def head(self, streams: jax.Array, logits_at=None) -> jax.Array:
        """HyperHead, final norm, LM head -> f32 logits [B, T, V] (or [B, 1, V] at logits_at [B])."""
        if logits_at is not None:
            streams = streams[jnp.arange(streams.shape[0]), logits_at][:, None]
        return super().head(self.hc_head(streams))


MODEL_CLASSES["deepseek_v4"] = DeepseekV4CausalLM


# ---- how the routed experts run ------------------------------------------------------------------

def executor_options(cfg: ModelConfig) -> dict[str, Any]:
    """The routed experts' clamp, for the device SwiGLU (the executor) and the host kernel
    (`HostExecutor(swiglu_limit=...)`) alike."""
    return {"swiglu_limit": cfg.dsv4.swiglu_limit}

