"""Multi-head latent attention (MLA): the attention layer kind of DeepSeek-V2/V3.

Keys and values are not cached per head. Each token is compressed to one latent
c_kv [R] (kv_a_proj_with_mqa, then kv_a_layernorm) plus one RoPE key k_pe [dr] shared by
all heads; per head h the keys and values are linear in the latent:

    k_h = [c_kv W_UK,h (dn) | k_pe (dr)],   v_h = c_kv W_UV,h (dv)     (W_UK | W_UV = kv_b_proj)
    q_h = [q_nope,h (dn)    | q_pe,h (dr)]                             (q_proj, or q_a -> norm -> q_b)

The layer's state is the latent cache, R + dr numbers per token instead of H·(dn+dr+dv):

    c_kv  [B, S, R]    the normalised latents
    k_pe  [B, S, dr]   the rotated RoPE keys

Two forms of the same attention (`latent_attention`), both blocked over the keys in use
with a running max and sum as `layers.blocked_attention`:
- expanded (prefill, T > 1): each block of latents is expanded to per-head K and V, as
  transformers does; T queries share every expansion.
- absorbed (decode, T = 1): W_UK is folded into the query (q_lat,h = q_nope,h W_UK,hᵀ [R]),
  so scores are q_lat·c_kv + q_pe·k_pe straight on the cache, the softmax-weighted sum is
  taken over the latents, and W_UV is applied once to that [H, R] result. Nothing of
  size S·H is ever materialised.

Sparse attention (GLM-5, `ftjax.models.dsa`) is this layer with one hook overridden:
`select_keys` (after this call's latents are written) may add leaves to the state and
return a per-query key mask `keep` [B, T, S], which `latent_attention` applies to every
key block besides causality; dense MLA returns None (every causal key).

RoPE: transformers 5 rotates q_pe and k_pe over interleaved pairs (x0, x1), (x2, x3), ...
when `rope_interleave` (DeepSeek-V3's checkpoints), else rotate-half. The interleaved form
is the rotate-half form on the de-interleaved vector [x0, x2, ... | x1, x3, ...] (its output
order too), which is how `mla_rope` computes it. The softmax scale is (dn + dr)^-1/2,
times YaRN's mscale² when the config scales RoPE (`MLAConfig.softmax_scale`).

Letters as in `ftjax.models.common` (R = kv_lora_rank, Rq = q_lora_rank, dn / dr / dv).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ftjax.config import ModelConfig
from ftjax.experts.storage import as_f32
from ftjax.models.layers import ATTENTION_BLOCK, layer_kind, resize_axis, write_rows
from ftjax.models.ops import RMSNorm, Step, apply_rope, linear, linear_param, param

_MASKED = -1e30  # finite: a fully masked block must not turn the running max into NaN
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps


def mla_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """x [B, T, heads, dr] rotated by cos, sin [B, T, dr]; interleave: over pairs (x0, x1),
    (x2, x3), ..., returned de-interleaved as transformers returns it."""
    if interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, cos, sin)


def split_kv_b(w: jax.Array, heads: int, nope: int, v: int) -> tuple[jax.Array, jax.Array]:
    """kv_b_proj as stored (float [R, H*(dn+dv)] or packed bf16 bits [H*(dn+dv), R]) ->
    W_UK [R, H, dn], W_UV [R, H, dv] float32."""
    w = as_f32(w).T if w.dtype == jnp.uint16 else w.astype(jnp.float32)
    w = w.reshape(w.shape[0], heads, nope + v)
    return w[..., :nope], w[..., nope:]


def latent_attention(q_nope: jax.Array, q_pe: jax.Array, c_kv: jax.Array, k_pe: jax.Array, w_uk: jax.Array,
                     w_uv: jax.Array, positions: jax.Array, kv_len: jax.Array, scale: float, absorbed: bool,
                     block: int = ATTENTION_BLOCK, keep: jax.Array | None = None) -> jax.Array:
    """Causal MLA over the latent cache prefix in use, one key block at a time.

    q_nope [B, T, H, dn], q_pe [B, T, H, dr] (rotated); c_kv [B, S, R], k_pe [B, S, dr];
    w_uk [R, H, dn], w_uv [R, H, dv]; positions [B, T]; kv_len [B] keys in use per row
    -> out [B, T, H, dv] float32. absorbed: the decode form (scores and values on the
    latents), else the expanded form (per-head K, V of each block); equal up to rounding.
    keep [B, T, S] bool (optional): the keys each query may see besides causality (sparse
    attention's selection, `ftjax.models.dsa`); every query must keep at least one key."""
    B, T, H, _ = q_nope.shape
    S, R = c_kv.shape[1], c_kv.shape[2]
    block = block if S % block == 0 else S
    q_pe = q_pe.astype(jnp.float32) * scale
    if absorbed:
        q_main = jnp.einsum("bthd,rhd->bthr", q_nope.astype(jnp.float32), w_uk) * scale  # [B, T, H, R]
        width = R
    else:
        q_main = q_nope.astype(jnp.float32) * scale  # [B, T, H, dn]
        width = w_uv.shape[-1]
    q_pos = positions[:, None, :, None]  # [B, 1, T, 1]
    stop = jnp.minimum((jnp.max(kv_len) + block - 1) // block, S // block)

    def attend_block(i, carry):
        m, l, acc = carry  # [B, H, T], [B, H, T], [B, H, T, width]
        k_pos = i * block + jnp.arange(block, dtype=jnp.int32)
        live = (k_pos[None, :] < kv_len[:, None])[..., None]  # [B, blk, 1]: rows past the keys in use -> 0
        cb = jnp.where(live, jax.lax.dynamic_slice_in_dim(c_kv, i * block, block, axis=1).astype(jnp.float32), 0.0)
        pb = jnp.where(live, jax.lax.dynamic_slice_in_dim(k_pe, i * block, block, axis=1).astype(jnp.float32), 0.0)
        s = jnp.einsum("bthd,bsd->bhts", q_pe, pb)  # [B, H, T, blk]
        if absorbed:
            s = s + jnp.einsum("bthr,bsr->bhts", q_main, cb)
        else:
            k_nope = jnp.einsum("bsr,rhd->bshd", cb, w_uk)  # [B, blk, H, dn]
            s = s + jnp.einsum("bthd,bshd->bhts", q_main, k_nope)
        visible = k_pos <= q_pos  # [B, 1, T, blk]
        if keep is not None:
            visible = visible & jax.lax.dynamic_slice_in_dim(keep, i * block, block, axis=2)[:, None]
        s = jnp.where(visible, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        rescale = jnp.exp(m - m_new)
        if absorbed:
            pv = jnp.einsum("bhts,bsr->bhtr", p, cb)  # [B, H, T, R]
        else:
            pv = jnp.einsum("bhts,bshd->bhtd", p, jnp.einsum("bsr,rhd->bshd", cb, w_uv))  # [B, H, T, dv]
        return m_new, l * rescale + jnp.sum(p, axis=-1), acc * rescale[..., None] + pv

    def body(i, carry):  # static trip count; blocks past the keys in use are skipped
        return jax.lax.cond(i < stop, attend_block, lambda i, c: c, i, carry)

    init = (jnp.full((B, H, T), _MASKED, jnp.float32), jnp.zeros((B, H, T), jnp.float32),
            jnp.zeros((B, H, T, width), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, S // block, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # [B, H, T, width]
    if absorbed:
        return jnp.einsum("bhtr,rhd->bthd", out, w_uv)
    return out.transpose(0, 2, 1, 3)


@layer_kind("mla")
class LatentAttention(nnx.Module):
    """DeepSeek-V3 attention over a latent cache {"c_kv" [B, S, R], "k_pe" [B, S, dr]}."""

    SEQ_AXES = {"c_kv": 1, "k_pe": 1}

    def __init__(self, cfg: ModelConfig, layer: int, dtype=jnp.float32, packed: bool = False):
        m, D, H = cfg.mla, cfg.d_model, cfg.num_heads
        self.cfg = cfg
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            self.wq = linear_param(D, H * qk, dtype, packed)
        else:
            self.w_q_a = linear_param(D, m.q_lora_rank, dtype, packed)
            self.q_a_norm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.w_q_b = linear_param(m.q_lora_rank, H * qk, dtype, packed)
            if m.attention_bias:
                self.b_q_a = param((m.q_lora_rank,), dtype)
        self.w_kv_a = linear_param(D, m.kv_lora_rank + m.qk_rope_head_dim, dtype, packed)
        if m.attention_bias:
            self.b_kv_a, self.bo = param((m.kv_lora_rank + m.qk_rope_head_dim,), dtype), param((D,), dtype)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.w_kv_b = linear_param(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), dtype, packed)
        self.wo = linear_param(H * m.v_head_dim, D, dtype, packed)

    # ---- state ------------------------------------------------------------------------
    @staticmethod
    def init_state(cfg: ModelConfig, layer: int, batch: int, max_len: int, dtype=jnp.float32) -> dict[str, Any]:
        m = cfg.mla
        return {"c_kv": jnp.zeros((batch, max_len, m.kv_lora_rank), dtype),
                "k_pe": jnp.zeros((batch, max_len, m.qk_rope_head_dim), dtype)}

    @staticmethod
    def resize_state(state: dict[str, Any], max_len: int) -> dict[str, Any]:
        return {name: resize_axis(a, max_len, axis=1) for name, a in state.items()}

    # ---- forward ------------------------------------------------------------------------
    def _query(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """x [B, T, D] -> q [B, T, H*(dn+dr)], the normalised query latent [B, T, Rq] (None
        without a q down-projection)."""
        m = self.cfg.mla
        if m.q_lora_rank is None:
            return linear(x, self.wq[...]), None
        q = linear(x, self.w_q_a[...])  # [B, T, Rq]
        if m.attention_bias:
            q = q + self.b_q_a[...]
        q_latent = self.q_a_norm(q)
        return linear(q_latent, self.w_q_b[...]), q_latent

    def project(self, x: jax.Array, step: Step):
        """x [B, T, D] -> q_nope [B, T, H, dn], q_pe [B, T, H, dr] (rotated), c_kv [B, T, R],
        k_pe [B, T, dr] (rotated): this call's queries and cache rows; and the query latent
        [B, T, Rq] (or None) a key selector may read."""
        m, H = self.cfg.mla, self.cfg.num_heads
        B, T, _ = x.shape
        dn, R = m.qk_nope_head_dim, m.kv_lora_rank
        q, q_latent = self._query(x)
        q = q.reshape(B, T, H, dn + m.qk_rope_head_dim)
        kv = linear(x, self.w_kv_a[...])  # [B, T, R+dr]
        if m.attention_bias:
            kv = kv + self.b_kv_a[...]
        cos, sin = step.rope
        q_pe = mla_rope(q[..., dn:], cos, sin, m.rope_interleave)
        k_pe = mla_rope(kv[:, :, None, R:], cos, sin, m.rope_interleave)[:, :, 0]
        return q[..., :dn], q_pe, self.kv_a_norm(kv[..., :R]), k_pe, q_latent

    def select_keys(self, x: jax.Array, q_latent: jax.Array | None, step: Step,
                    state: dict[str, Any]) -> tuple[jax.Array | None, dict[str, Any]]:
        """Hook for sparse attention: x [B, T, D], the query latent, the state with this
        call's latents written -> (keep [B, T, S] bool or None = every causal key, state).
        Dense MLA keeps every key; `ftjax.models.dsa` overrides it with its indexer."""
        return None, state

    def __call__(self, x: jax.Array, step: Step, state: dict[str, Any]):
        """x [B, T, D] -> out [B, T, D], state with this call's latents written."""
        m, H = self.cfg.mla, self.cfg.num_heads
        B, T, _ = x.shape
        q_nope, q_pe, c_kv, k_pe, q_latent = self.project(x, step)
        state = {**state, "c_kv": write_rows(state["c_kv"], c_kv, step.start, axis=1),
                 "k_pe": write_rows(state["k_pe"], k_pe, step.start, axis=1)}
        keep, state = self.select_keys(x, q_latent, step, state)
        w_uk, w_uv = split_kv_b(self.w_kv_b[...], H, m.qk_nope_head_dim, m.v_head_dim)
        scale = m.softmax_scale or (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
        out = latent_attention(q_nope, q_pe, state["c_kv"], state["k_pe"], w_uk, w_uv, step.positions,
                               step.start + T, scale, absorbed=T == 1, keep=keep)
        out = linear(out.reshape(B, T, H * m.v_head_dim).astype(x.dtype), self.wo[...])
        if m.attention_bias:
            out = out + self.bo[...]
        return out, state
