"""The shared MoE decoder: embedding, L decoder layers (a layer kind's mixer, then a
dense SwiGLU MLP or the MoE block), final norm and LM head.

Dimension legend (used in every shape comment of the package):
    B batch, T query tokens, S cache length, D model dim, F expert FFN dim,
    E experts, K top-k, H heads, G kv heads, L layers, Lm MoE layers, V vocab, N = B*T,
    Ng expert groups (sigmoid_group routing), R latent width (MLA's kv_lora_rank),
    dn / dr / dv MLA's per-head no-RoPE / RoPE query-key dims and value dim.

Design
- Every supported family is this one decoder with switches held in `ModelConfig`
  (q/k norm kind, qkv bias, shared expert, MoE vs dense layers, sliding windows, and the
  layer kind of each layer). Family files only translate HF configs and tensor names.
- Each layer's token mixer is a *layer kind* (`ftjax.models.layers`) that owns its state:
  the model's state is the tuple of the layers' state pytrees (`init_state`), threaded
  through the forward pass and donated by the compiled steps. Every row of the batch has
  its own position (`Step.start`), so sessions at different positions decode together.
- The router is data too (`ModelConfig.router`): "softmax" (softmax over all experts,
  top-k, optionally renormalised: Qwen, Mixtral, OLMoE) or "sigmoid_group" (DeepSeek-V3,
  GLM-4.5: sigmoid scores, selection on scores + a learned correction bias limited to
  the best expert groups, weights from the unbiased scores). Both end in the same
  (ids [N, K] int32, weights [N, K]) the executor takes; so do DeepSeek-V4's hash and
  sqrtsoftplus top-k routers ("deepseek_v4": `ftjax.models.deepseek_v4`, a family with its
  own decoder subclass, registered in `MODEL_CLASSES` and built by `causal_lm`).
- Routed expert weights are NOT parameters of these modules. The MoE block computes
  the router, then hands (token, expert, weight) assignments to an *expert executor*
  (`ftjax.experts.executor`), a static policy object plus a pytree of device state
  threaded through the forward pass. Placement is data: the forward code never
  decides where an expert runs.
- Linear weights are stored [in, out] (x @ W), or *packed*: bf16 bits (uint16) in the
  HF layout [out, in], multiplied by the host GEMV kernel on the CPU backend
  (`ftjax.models.ops.linear`; `CausalLM(cfg, packed=True)`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ftjax.config import ModelConfig
from ftjax.experts.storage import as_f32
from ftjax.models.layers import kind_class
from ftjax.models.ops import (  # noqa: F401  (linear, rms_norm, rope: part of this module's API)
    RMSNorm, Step, apply_rope, linear, linear_param, param, rms_norm, rope_cos_sin)

# An expert executor call: (moe_layer, x [N, D], expert_ids [N, K], weights [N, K],
# valid [N], executor_state) -> (y [N, D], executor_state).
ExpertCall = Callable[[int, jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]
State = tuple  # one state pytree per decoder layer (see ftjax.models.layers)


class DenseMLP(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, dtype=jnp.float32, packed: bool = False):
        self.w_gate, self.w_up = linear_param(d_model, d_ff, dtype, packed), linear_param(d_model, d_ff, dtype, packed)
        self.w_down = linear_param(d_ff, d_model, dtype, packed)

    def __call__(self, x: jax.Array) -> jax.Array:
        return linear(jax.nn.silu(linear(x, self.w_gate[...])) * linear(x, self.w_up[...]), self.w_down[...])


# The routers are jitted: traced and lowered once for all the layers (as ops.rms_norm).
@partial(jax.jit, static_argnames=("top_k", "normalize"))
def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax-then-top-k routing. logits [N, E] -> ids [N, K] int32, weights [N, K] f32."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


@partial(jax.jit, static_argnames=("top_k", "n_group", "topk_group", "normalize", "scale"))
def route_sigmoid_group(logits: jax.Array, bias: jax.Array, top_k: int, n_group: int, topk_group: int,
                        normalize: bool, scale: float) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3 routing (`noaux_tc`). logits [N, E], bias [E] (e_score_correction_bias)
    -> ids [N, K] int32, weights [N, K] f32.

    scores = sigmoid(logits); selection ranks scores + bias, first by group (the Ng
    groups of E/Ng consecutive experts score the sum of their top two, the best
    topk_group stay eligible), then the top K eligible experts; their weights are the
    unbiased scores, renormalised if `normalize`, times `scale`."""
    N, E = logits.shape
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    biased = scores + bias.astype(jnp.float32)  # [N, E]
    group_scores = jnp.sum(jax.lax.top_k(biased.reshape(N, n_group, E // n_group), 2)[0], axis=-1)  # [N, Ng]
    _, groups = jax.lax.top_k(group_scores, topk_group)  # [N, topk_group]
    kept = jnp.any(groups[:, :, None] == jnp.arange(n_group)[None, None, :], axis=1)  # [N, Ng]
    eligible = jnp.repeat(kept, E // n_group, axis=1)  # [N, E]
    _, ids = jax.lax.top_k(jnp.where(eligible, biased, -jnp.inf), top_k)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * scale


class MoEBlock(nnx.Module):
    """Router (+ shared expert); the routed experts run wherever the executor puts them."""

    def __init__(self, cfg: ModelConfig, moe_index: int, dtype=jnp.float32, packed: bool = False):
        self.cfg, self.moe_index = cfg, moe_index
        self.w_router = linear_param(cfg.d_model, cfg.num_experts, dtype, packed)
        if cfg.router == "sigmoid_group":
            self.router_bias = nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32))  # e_score_correction_bias [E]
        if cfg.shared_expert_d_ff:
            self.shared = DenseMLP(cfg.d_model, cfg.shared_expert_d_ff, dtype, packed)
            if cfg.shared_expert_gate:
                self.w_shared_gate = linear_param(cfg.d_model, 1, dtype, packed)

    def route(self, flat: jax.Array) -> tuple[jax.Array, jax.Array]:
        """flat [N, D] -> ids [N, K] int32, weights [N, K] f32, by the config's router."""
        cfg = self.cfg
        logits = linear(flat, self.w_router[...])  # [N, E]
        if cfg.router == "sigmoid_group":
            return route_sigmoid_group(logits, self.router_bias[...], cfg.top_k, cfg.n_group, cfg.topk_group,
                                       cfg.norm_topk_prob, cfg.routed_scaling_factor)
        return route(logits, cfg.top_k, cfg.norm_topk_prob)

    def __call__(self, x: jax.Array, valid: jax.Array, experts: ExpertCall, expert_state):
        """x [B, T, D], valid [B, T] -> [B, T, D]."""
        B, T, D = x.shape
        flat = x.reshape(B * T, D)  # [N, D]
        ids, weights = self.route(flat)
        y, expert_state = experts(self.moe_index, flat, ids, weights.astype(flat.dtype), valid.reshape(-1), expert_state)
        if self.cfg.shared_expert_d_ff:
            shared = self.shared(flat)
            if self.cfg.shared_expert_gate:
                shared = jax.nn.sigmoid(linear(flat, self.w_shared_gate[...])) * shared
            y = y + shared
        return y.reshape(B, T, D), expert_state


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype=jnp.float32, packed: bool = False):
        self.layer, self.is_moe = layer, cfg.moe_layers[layer]
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        self.attn = kind_class(cfg.layer_kind(layer))(cfg, layer, dtype, packed)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        if self.is_moe:
            self.moe = MoEBlock(cfg, cfg.moe_index(layer), dtype, packed)
        else:
            self.mlp = DenseMLP(cfg.d_model, cfg.d_ff, dtype, packed)

    def __call__(self, x, step: Step, state, experts: ExpertCall, expert_state):
        h, state = self.attn(self.attn_norm(x), step, state)
        x = x + h
        h = self.mlp_norm(x)
        if self.is_moe:
            h, expert_state = self.moe(h, step.valid, experts, expert_state)
        else:
            h = self.mlp(h)
        return x + h, state, expert_state


MODEL_CLASSES: dict[str, type] = {}  # model_type -> its own CausalLM subclass (families whose decoder differs)


def causal_lm(cfg: ModelConfig, dtype=jnp.float32, packed: bool = False) -> "CausalLM":
    """The decoder of `cfg`'s family: `CausalLM`, or the subclass a family registered in
    `MODEL_CLASSES` (DeepSeek-V4's hyper-connections, `ftjax.models.deepseek_v4`)."""
    return MODEL_CLASSES.get(cfg.model_type, CausalLM)(cfg, dtype, packed)


class CausalLM(nnx.Module):
    """Embedding -> L decoder layers -> norm -> LM head. Expert weights live outside.

    packed: every matrix is bf16 bits [out, in] (see `linear`) and the embedding
    [V, D] is bf16 bits too; norms and biases stay `dtype`."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, packed: bool = False):
        self.cfg = cfg
        self.embed = param((cfg.vocab_size, cfg.d_model), jnp.uint16 if packed else dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, packed) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        if not cfg.tie_embeddings:
            self.lm_head = linear_param(cfg.d_model, cfg.vocab_size, dtype, packed)

    def __call__(self, tokens, start, valid, state: State, experts: ExpertCall, expert_state, logits_at=None):
        """tokens [B, T] at positions start[b]..start[b]+T-1 -> logits [B, T, V] f32, state,
        expert_state.

        start [B] (or a scalar for every row); state: `init_state(cfg, B, S)`; valid [B, T]
        marks real (non-padding, active) tokens; logits_at [B] (optional): compute logits
        only at that query index -> [B, 1, V].
        """
        B, T = tokens.shape
        step = self.step(start, valid)
        x = self.embed_tokens(tokens)
        new_state = []
        for layer, layer_state in zip(self.layers, state):
            x, layer_state, expert_state = layer(x, step, layer_state, experts, expert_state)
            new_state.append(layer_state)
        return self.head(x, logits_at), tuple(new_state), expert_state

    def step(self, start, valid) -> Step:
        """The per-call context: positions [B, T] from start [B] and their RoPE."""
        B, T = valid.shape
        start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (B,))
        positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        return Step(positions, start, valid, rope_cos_sin(positions, self.cfg.rope_dim, self.cfg.rope_theta,
                                                         self.cfg.rope_scaling))

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        rows = self.embed[...][tokens]  # [B, T, D]
        return as_f32(rows) if rows.dtype == jnp.uint16 else rows

    def head(self, x: jax.Array, logits_at=None) -> jax.Array:
        """Final norm + LM head -> f32 logits [B, T, V] (or [B, 1, V] at logits_at [B])."""
        if logits_at is not None:
            x = x[jnp.arange(x.shape[0]), logits_at][:, None]  # [B, 1, D]
        x = self.norm(x)
        if self.cfg.tie_embeddings:  # embed [V, D]: packed it is already [out, in]
            embed = self.embed[...]
            return (linear(x, embed) if embed.dtype == jnp.uint16 else x @ embed.T).astype(jnp.float32)
        return linear(x, self.lm_head[...]).astype(jnp.float32)


def init_state(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> State:
    """Fresh state for `batch` rows of capacity `max_len`: each layer kind's own pytree,
    its cached activations (e.g. attention's K and V) stored as `dtype`."""
    return tuple(kind_class(cfg.layer_kind(i)).init_state(cfg, i, batch, max_len, dtype)
                 for i in range(cfg.num_layers))


@partial(jax.jit, static_argnames=("cfg", "batch", "max_len", "dtype"))
def fresh_state(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> State:
    """`init_state` as one compiled program: run eagerly, its two or three ops a layer
    each compile on first use (~50 ms of a restarted process's first prompt on the default
    model); one program per shape is compiled once, or read back from the persistent cache."""
    return init_state(cfg, batch, max_len, dtype)


def resize_state(cfg: ModelConfig, state: State, max_len: int) -> State:
    """The same state with its sequence capacity grown (zeros) or trimmed to `max_len`."""
    return tuple(kind_class(cfg.layer_kind(i)).resize_state(s, max_len) for i, s in enumerate(state))



@partial(jax.jit, static_argnames=("cfg", "size"))
def take_segment(cfg: ModelConfig, state: State, start: jax.Array, size: int) -> State:
    """What row 0 of a state holds for tokens [start, start + size): each kind's per-token
    leaves (`SEQ_AXES`) gathered at those positions (past the end: the last row again),
    every fixed leaf whole (its value at the state's position). `size` is static and
    `start` data, so one compile serves every start (callers round sizes up to a
    bucket); the result is a new buffer."""
    def take(kind, layer):
        axes = kind_class(kind).SEQ_AXES
        out = {}
        for name, a in layer.items():
            if name in axes:
                idx = jnp.minimum(start + jnp.arange(size), a.shape[axes[name]] - 1)
                out[name] = jnp.take(a, idx, axis=axes[name])
            else:
                out[name] = a
        return out
    return tuple(take(cfg.layer_kind(i), layer) for i, layer in enumerate(state))


@partial(jax.jit, static_argnames=("cfg", "last"), donate_argnums=(1,))
def put_segment(cfg: ModelConfig, state: State, segment: State, offset: jax.Array, last: bool) -> State:
    """Write a segment (`take_segment`) into row 0 of a state at token `offset` (rows
    past the capacity dropped); `last`: its fixed leaves become the state's. Segments
    written in order rebuild the state they were taken from: a segment's padding rows
    land where the next one writes, or past the position (never attended)."""
    def put(kind, dst, seg):
        axes = kind_class(kind).SEQ_AXES
        out = {}
        for name, a in dst.items():
            if name in axes:
                ax = axes[name]
                idx = offset + jnp.arange(seg[name].shape[ax])
                index = (slice(None),) * ax + (idx,)
                out[name] = a.at[index].set(seg[name].astype(a.dtype), mode="drop")
            else:
                out[name] = seg[name].astype(a.dtype) if last else a
        return out
    return tuple(put(cfg.layer_kind(i), d, g) for i, (d, g) in enumerate(zip(state, segment)))
