"""The shared MoE decoder: RMSNorm, RoPE, GQA attention over a preallocated KV cache,
dense SwiGLU MLP, and the MoE block (router + optional shared expert).

Dimension legend (used in every shape comment of the package):
    B batch, T query tokens, S cache length, D model dim, F expert FFN dim,
    E experts, K top-k, H heads, G kv heads, L layers, Lm MoE layers, V vocab, N = B*T.

Design
- Every supported family is this one decoder with switches held in `ModelConfig`
  (q/k norm kind, qkv bias, shared expert, MoE vs dense layers, sliding windows).
  Family files only translate HF configs and tensor names.
- Routed expert weights are NOT parameters of these modules. The MoE block computes
  the router, then hands (token, expert, weight) assignments to an *expert executor*
  (`ftjax.experts.executor`), a static policy object plus a pytree of device state
  threaded through the forward pass. Placement is data: the forward code never
  decides where an expert runs.
- Linear weights are stored [in, out] (x @ W), or *packed*: bf16 bits (uint16) in the
  HF layout [out, in], multiplied by the host GEMV kernel on the CPU backend
  (`linear`, `ftjax.host.linear`; `CausalLM(cfg, packed=True)`). The KV cache is a pytree
  {"k", "v"}: [L, B, S, G, hd], written at `start` and attended with a position mask,
  so prefill and decode are the same code path.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ftjax import host
from ftjax.config import ModelConfig
from ftjax.experts.executor import as_f32

# An expert executor call: (moe_layer, x [N, D], expert_ids [N, K], weights [N, K],
# valid [N], executor_state) -> (y [N, D], executor_state).
ExpertCall = Callable[[int, jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def _param(shape: tuple[int, ...], dtype) -> nnx.Param:
    # Placeholders: real values come from the checkpoint (or an init function).
    return nnx.Param(jnp.zeros(shape, dtype))


def _linear_param(d_in: int, d_out: int, dtype, packed: bool) -> nnx.Param:
    return _param((d_out, d_in), jnp.uint16) if packed else _param((d_in, d_out), dtype)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] -> [..., out]; w float [in, out], or packed uint16 [out, in]."""
    if w.dtype == jnp.uint16:
        return host.linear(x, w).astype(x.dtype)
    return x @ w


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((size,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, hd] for the default (non-scaled) rotary embedding."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, heads, hd]; rotate-half convention (as HF)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def attention_mask(q_pos: jax.Array, cache_len: int, window: int) -> jax.Array:
    """Boolean [B, T, S]: key at position s visible to the query at position q."""
    k_pos = jnp.arange(cache_len, dtype=jnp.int32)[None, None, :]
    q = q_pos[:, :, None]
    visible = k_pos <= q
    if window > 0:
        visible &= k_pos > q - window
    return visible


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype=jnp.float32, packed: bool = False):
        D, H, G, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg, self.window = cfg, cfg.sliding_windows[layer]
        self.wq = _linear_param(D, H * hd, dtype, packed)
        self.wk, self.wv = _linear_param(D, G * hd, dtype, packed), _linear_param(D, G * hd, dtype, packed)
        self.wo = _linear_param(H * hd, D, dtype, packed)
        if cfg.qkv_bias:
            self.bq, self.bk, self.bv = _param((H * hd,), dtype), _param((G * hd,), dtype), _param((G * hd,), dtype)
        if cfg.o_bias:
            self.bo = _param((D,), dtype)
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype), RMSNorm(hd, cfg.rms_norm_eps, dtype)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(H * hd, cfg.rms_norm_eps, dtype), RMSNorm(G * hd, cfg.rms_norm_eps, dtype)

    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        q, k, v = linear(x, self.wq[...]), linear(x, self.wk[...]), linear(x, self.wv[...])  # [B, T, H*hd], [B, T, G*hd] x2
        if cfg.qkv_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        if cfg.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.clip_qkv is not None:
            c = cfg.clip_qkv
            q, k, v = jnp.clip(q, -c, c), jnp.clip(k, -c, c), jnp.clip(v, -c, c)
        B, T, _ = x.shape
        q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
        k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def __call__(self, x, positions, start, rope, layer: int, kv):
        """x [B, T, D]; positions [B, T]; kv {"k","v"}: [L, B, S, G, hd] -> out [B, T, D], kv.

        The new keys/values are written into the whole (donated) cache array in place;
        this layer then reads its own [B, S, G, hd] slice.
        """
        cfg = self.cfg
        q, k, v = self._project(x)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        at = (layer, 0, start, 0, 0)
        kv = {
            "k": jax.lax.dynamic_update_slice(kv["k"], k[None].astype(kv["k"].dtype), at),
            "v": jax.lax.dynamic_update_slice(kv["v"], v[None].astype(kv["v"].dtype), at),
        }
        cache_k, cache_v = kv["k"][layer], kv["v"][layer]

        B, T, H, hd = q.shape
        G, S = cfg.num_kv_heads, cache_k.shape[1]
        q = q.reshape(B, T, G, H // G, hd)
        scores = jnp.einsum("btgrd,bsgd->bgrts", q, cache_k.astype(q.dtype)) * hd**-0.5  # [B, G, H/G, T, S]
        mask = attention_mask(positions, S, self.window)[:, None, None]  # [B, 1, 1, T, S]
        scores = jnp.where(mask, scores.astype(jnp.float32), -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        out = jnp.einsum("bgrts,bsgd->btgrd", probs, cache_v.astype(q.dtype)).reshape(B, T, H * hd)
        out = linear(out, self.wo[...])
        if cfg.o_bias:
            out = out + self.bo[...]
        return out, kv


class DenseMLP(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, dtype=jnp.float32, packed: bool = False):
        self.w_gate, self.w_up = _linear_param(d_model, d_ff, dtype, packed), _linear_param(d_model, d_ff, dtype, packed)
        self.w_down = _linear_param(d_ff, d_model, dtype, packed)

    def __call__(self, x: jax.Array) -> jax.Array:
        return linear(jax.nn.silu(linear(x, self.w_gate[...])) * linear(x, self.w_up[...]), self.w_down[...])


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax-then-top-k routing. logits [N, E] -> ids [N, K] int32, weights [N, K] f32."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


class MoEBlock(nnx.Module):
    """Router (+ shared expert); the routed experts run wherever the executor puts them."""

    def __init__(self, cfg: ModelConfig, moe_index: int, dtype=jnp.float32, packed: bool = False):
        self.cfg, self.moe_index = cfg, moe_index
        self.w_router = _linear_param(cfg.d_model, cfg.num_experts, dtype, packed)
        if cfg.shared_expert_d_ff:
            self.shared = DenseMLP(cfg.d_model, cfg.shared_expert_d_ff, dtype, packed)
            if cfg.shared_expert_gate:
                self.w_shared_gate = _linear_param(cfg.d_model, 1, dtype, packed)

    def __call__(self, x: jax.Array, valid: jax.Array, experts: ExpertCall, expert_state):
        """x [B, T, D], valid [B, T] -> [B, T, D]."""
        B, T, D = x.shape
        flat = x.reshape(B * T, D)  # [N, D]
        ids, weights = route(linear(flat, self.w_router[...]), self.cfg.top_k, self.cfg.norm_topk_prob)
        y, expert_state = experts(self.moe_index, flat, ids, weights.astype(flat.dtype), valid.reshape(-1), expert_state)
        if self.cfg.shared_expert_d_ff:
            shared = self.shared(flat)
            if self.cfg.shared_expert_gate:
                shared = jax.nn.sigmoid(linear(flat, self.w_shared_gate[...])) * shared
            y = y + shared
        return y.reshape(B, T, D), expert_state


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype=jnp.float32, packed: bool = False):
        self.layer = layer
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, layer, dtype, packed)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, dtype)
        if cfg.moe_layers[layer]:
            self.moe = MoEBlock(cfg, cfg.moe_index(layer), dtype, packed)
        else:
            self.mlp = DenseMLP(cfg.d_model, cfg.d_ff, dtype, packed)

    def __call__(self, x, positions, start, valid, rope, kv, experts, expert_state):
        h, kv = self.attn(self.attn_norm(x), positions, start, rope, self.layer, kv)
        x = x + h
        h = self.mlp_norm(x)
        if hasattr(self, "moe"):
            h, expert_state = self.moe(h, valid, experts, expert_state)
        else:
            h = self.mlp(h)
        return x + h, kv, expert_state


class CausalLM(nnx.Module):
    """Embedding -> L decoder layers -> norm -> LM head. Expert weights live outside.

    packed: every matrix is bf16 bits [out, in] (see `linear`) and the embedding
    [V, D] is bf16 bits too; norms and biases stay `dtype`."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, packed: bool = False):
        self.cfg = cfg
        self.embed = _param((cfg.vocab_size, cfg.d_model), jnp.uint16 if packed else dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, packed) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, dtype)
        if not cfg.tie_embeddings:
            self.lm_head = _linear_param(cfg.d_model, cfg.vocab_size, dtype, packed)

    def __call__(self, tokens, start, valid, kv, experts: ExpertCall, expert_state, logits_at=None):
        """tokens [B, T] at positions start..start+T-1 -> logits [B, T, V] f32, kv, expert_state.

        kv: {"k": [L, B, S, G, hd], "v": same}. valid [B, T] marks real (non-padding) tokens.
        logits_at [B] (optional): compute logits only at that query index -> [B, 1, V].
        """
        B, T = tokens.shape
        positions, rope = self.positions(start, B, T)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x, kv, expert_state = layer(x, positions, start, valid, rope, kv, experts, expert_state)
        return self.head(x, logits_at), kv, expert_state

    def positions(self, start, batch: int, length: int):
        """positions [B, T] from start, and their RoPE (cos, sin) [B, T, hd]."""
        positions = jnp.broadcast_to(start + jnp.arange(length, dtype=jnp.int32), (batch, length))
        return positions, rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)

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


def empty_kv_cache(cfg: ModelConfig, batch: int, cache_len: int, dtype=jnp.float32) -> dict[str, jax.Array]:
    shape = (cfg.num_layers, batch, cache_len, cfg.num_kv_heads, cfg.head_dim)  # [L, B, S, G, hd]
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
