"""DeepSeek sparse attention (DSA): the attention layer kind of GLM-5 (`glm_moe_dsa`).

It is multi-head latent attention (`ftjax.models.mla`) in which each query attends only
the k = index_topk cached keys a small "lightning indexer" scores highest (every key
while a query sees at most k). The indexer has its own heads (Hi of width di) and its
own key per token, shared by its heads:

    k_idx  = LayerNorm(x W_k)                          [di]   (weight and bias, eps 1e-6)
    q_idx  = q_latent W_qb                             [Hi, di]  (q_latent: MLA's q_a_layernorm output)
    w      = x W_weights · Hi^-1/2                     [Hi]     (one weight per head and query)
    score(t, s) = Σ_h w_h · relu(q_idx,h(t) · k_idx(s) · di^-1/2)
    keep(t) = the k keys s <= t of highest score

RoPE covers the first dr (= qk_rope_head_dim) dims of q_idx and k_idx, over interleaved
pairs, output de-interleaved (`mla.mla_rope`), the rest pass through: transformers'
`GlmMoeDsaIndexer` exactly. Everything after the projections is float32, as there.

State: the latent cache plus the indexer's key cache, all per-token leaves on axis 1,

    c_kv  [B, S, R]    k_pe  [B, S, dr]    idx_k [B, S, di]

so the session engine grows, trims, stacks, snapshots and segments it like MLA's.

Selection (`index_scores`, `top_k_keep`): the scores of this call's queries over the
cached keys in use are computed one 512-key block at a time ([B, T, Hi, block] at most)
into [B, T, S] (keys not visible: -inf), then `lax.top_k` over S gives the k-th best
(score, position) per query, and `keep` = every key above it, or equal to it at a lower
or equal position: exactly the top-k set, without a scatter. While no query of the call
sees more than k keys (max(kv_len) <= k) the indexer scores are skipped (a `lax.cond`):
the selection is every causal key. `keep` enters `mla.latent_attention` as an extra
mask on each key block, in both the expanded (prefill) and absorbed (decode) forms.

Cost: O(T·S·Hi·di) for the scores and O(T·S) memory per layer call (one float per
query and key): prompts are prefilled in chunks (`prefill_chunk`) to bound it.

Ties: keys whose index scores are exactly equal at the k-th place are kept lowest
position first (`top_k_keep`). They are frequent: a key for which every head's relu
vanishes scores exactly 0, which with Hi heads happens to about one key in 2^Hi. torch's
`topk` orders equal values as its algorithm happens to (on the CPU, not lowest index
first), so transformers keeps other tied keys; the parity tests give the reference the
same rule (`tests/hf_models.stable_topk`) and check that ties did occur.

IndexShare (GLM-5.2, `indexer_types` "shared"): a layer of kind `mla_dsa_shared` has no
indexer and reuses the keep mask of the last `mla_dsa` layer before it in the same
forward pass, as transformers passes `prev_topk_indices` up the layers.

Letters as in `ftjax.models.common`, plus Hi / di (index_n_heads / index_head_dim).
"""

from __future__ import annotations

import contextvars
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ftjax.config import ModelConfig
from ftjax.models.layers import ATTENTION_BLOCK, layer_kind, write_rows
from ftjax.models.mla import LatentAttention, mla_rope
from ftjax.models.ops import Step, linear, linear_param

INDEXER_NORM_EPS = 1e-6  # the indexer's k_norm (nn.LayerNorm(di, eps=1e-6) in transformers)

# The selection of the last `mla_dsa` layer traced in this forward pass, for the
# `mla_dsa_shared` layers after it (GLM-5.2's IndexShare). A forward pass is one trace
# through the layers in order, and its first DSA layer always has an indexer, so a shared
# layer reads the keep mask of the same trace.
_LAST_SELECTION: contextvars.ContextVar = contextvars.ContextVar("dsa_last_selection")


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis (biased variance), in float32 -> x.dtype."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centred = x32 - mean
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    y = centred * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def rope_head(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, heads, di]: interleaved RoPE on the first dr dims (dr = cos.shape[-1]),
    the rest unchanged -> [B, T, heads, di]."""
    dr = cos.shape[-1]
    return jnp.concatenate([mla_rope(x[..., :dr], cos, sin, True), x[..., dr:]], axis=-1)


def index_scores(q: jax.Array, w: jax.Array, keys: jax.Array, positions: jax.Array, kv_len: jax.Array,
                 scale: float, block: int = ATTENTION_BLOCK) -> jax.Array:
    """The indexer's score of every cached key for every query.

    q [B, T, Hi, di] (rotated), w [B, T, Hi] (head weights, Hi^-1/2 included), keys
    [B, S, di] (the indexer key cache), positions [B, T], kv_len [B] keys in use per row
    -> [B, T, S] float32, -inf where the key is not visible (after the query, or past the
    keys in use). One key block at a time: blocks past max(kv_len) are skipped."""
    B, T, Hi, _ = q.shape
    S = keys.shape[1]
    block = block if S % block == 0 else S
    q = q.astype(jnp.float32)
    w = w.astype(jnp.float32)
    q_pos = positions[:, :, None]  # [B, T, 1]
    stop = jnp.minimum((jnp.max(kv_len) + block - 1) // block, S // block)

    def score_block(i, out):
        kb = jax.lax.dynamic_slice_in_dim(keys, i * block, block, axis=1).astype(jnp.float32)  # [B, blk, di]
        s = jax.nn.relu(jnp.einsum("bthd,bsd->bths", q, kb) * scale)  # [B, T, Hi, blk]
        s = jnp.einsum("bth,bths->bts", w, s)  # [B, T, blk]
        k_pos = i * block + jnp.arange(block, dtype=jnp.int32)
        s = jnp.where(k_pos <= q_pos, s, -jnp.inf)
        return jax.lax.dynamic_update_slice_in_dim(out, s, i * block, axis=2)

    def body(i, out):
        return jax.lax.cond(i < stop, score_block, lambda i, o: o, i, out)

    return jax.lax.fori_loop(0, S // block, body, jnp.full((B, T, S), -jnp.inf, jnp.float32))


def top_k_keep(scores: jax.Array, k: int) -> jax.Array:
    """scores [B, T, S] -> keep [B, T, S] bool: the k best keys of each query; among keys
    tied at the k-th score, the lowest positions. Where fewer than k keys are visible the
    set also holds some -inf (invisible) keys; attention's causal mask drops them.

    Ties are common, not a corner case: a key whose every head's relu term vanishes
    scores exactly 0, so with few indexer heads several keys tie at 0 (with 4 heads one
    key in 16). Only the k-th *value* is taken from `lax.top_k` (it is the same whatever
    order an implementation gives equal values); the tied keys are then kept by position
    with a running count, so the selection is one rule, the same in every chunking of a
    prompt and on every backend."""
    kth = jax.lax.top_k(scores, k)[0][..., -1:]  # [B, T, 1] the k-th best score
    above = scores > kth
    tied = scores == kth
    room = k - jnp.sum(above, axis=-1, keepdims=True)  # tied keys still to keep
    return above | (tied & (jnp.cumsum(tied, axis=-1) <= room))


class LayerNorm(nnx.Module):
    def __init__(self, size: int, eps: float, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((size,), dtype))
        self.bias = nnx.Param(jnp.zeros((size,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.weight[...], self.bias[...], self.eps)


class Indexer(nnx.Module):
    """The lightning indexer's projections (checkpoint names `self_attn.indexer.*`)."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, packed: bool = False):
        d, D = cfg.dsa, cfg.d_model
        self.cfg = cfg
        self.wq_b = linear_param(cfg.mla.q_lora_rank, d.index_n_heads * d.index_head_dim, dtype, packed)
        self.wk = linear_param(D, d.index_head_dim, dtype, packed)
        self.k_norm = LayerNorm(d.index_head_dim, INDEXER_NORM_EPS, dtype)
        self.weights_proj = linear_param(D, d.index_n_heads, dtype, packed)

    def keys(self, x: jax.Array, step: Step) -> jax.Array:
        """x [B, T, D] -> this call's indexer keys [B, T, di] (normalised, rotated)."""
        k = self.k_norm(linear(x, self.wk[...]))  # [B, T, di]
        cos, sin = step.rope
        return rope_head(k[:, :, None], cos, sin)[:, :, 0]

    def queries(self, q_latent: jax.Array, step: Step) -> jax.Array:
        """q_latent [B, T, Rq] -> indexer queries [B, T, Hi, di] (rotated)."""
        d = self.cfg.dsa
        B, T, _ = q_latent.shape
        q = linear(q_latent, self.wq_b[...]).reshape(B, T, d.index_n_heads, d.index_head_dim)
        cos, sin = step.rope
        return rope_head(q, cos, sin)

    def head_weights(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> w [B, T, Hi] float32 (times Hi^-1/2)."""
        return linear(x, self.weights_proj[...]).astype(jnp.float32) * self.cfg.dsa.index_n_heads ** -0.5

    def select(self, x: jax.Array, q_latent: jax.Array, step: Step, keys: jax.Array) -> jax.Array | None:
        """keep [B, T, S] bool for this call's queries over the key cache [B, S, di] (this
        call's keys written), or None when the cache cannot hold more than k keys."""
        d = self.cfg.dsa
        B, T, _ = x.shape
        S = keys.shape[1]
        k = min(d.index_topk, S)
        if k == S:  # static: no query can see more than k keys
            return None
        kv_len = step.start + T

        def sparse():
            scores = index_scores(self.queries(q_latent, step), self.head_weights(x), keys, step.positions, kv_len,
                                  d.index_head_dim ** -0.5)
            return top_k_keep(scores, k)

        return jax.lax.cond(jnp.max(kv_len) <= k, lambda: jnp.ones((B, T, S), bool), sparse)


@layer_kind("mla_dsa")
class SparseLatentAttention(LatentAttention):
    """MLA whose queries attend only the indexer's top-k keys; state {"c_kv", "k_pe",
    "idx_k" [B, S, di]}. Everything else (projections, absorbed decode) is `mla`'s."""

    SEQ_AXES = {"c_kv": 1, "k_pe": 1, "idx_k": 1}

    def __init__(self, cfg: ModelConfig, layer: int, dtype=jnp.float32, packed: bool = False):
        super().__init__(cfg, layer, dtype, packed)
        self.indexer = Indexer(cfg, dtype, packed)

    @staticmethod
    def init_state(cfg: ModelConfig, layer: int, batch: int, max_len: int, dtype=jnp.float32) -> dict[str, Any]:
        state = LatentAttention.init_state(cfg, layer, batch, max_len, dtype)
        return {**state, "idx_k": jnp.zeros((batch, max_len, cfg.dsa.index_head_dim), dtype)}

    def select_keys(self, x: jax.Array, q_latent: jax.Array | None, step: Step,
                    state: dict[str, Any]) -> tuple[jax.Array | None, dict[str, Any]]:
        """Write this call's indexer keys, then select each query's top-k keys."""
        idx_k = write_rows(state["idx_k"], self.indexer.keys(x, step), step.start, axis=1)
        state = {**state, "idx_k": idx_k}
        keep = self.indexer.select(x, q_latent, step, idx_k)
        _LAST_SELECTION.set(keep)
        return keep, state


@layer_kind("mla_dsa_shared")
class SharedSparseLatentAttention(LatentAttention):
    """IndexShare (GLM-5.2): MLA that attends the keys the previous `mla_dsa` layer's
    indexer selected for the same queries, with no indexer (nor its key cache) of its
    own; state {"c_kv", "k_pe"} as `mla`. The selection is passed within one forward
    trace, so a model with shared layers cannot run one layer per program (no streamed
    prefill: `glm_moe_dsa.streamed_prefill`)."""

    def select_keys(self, x: jax.Array, q_latent: jax.Array | None, step: Step,
                    state: dict[str, Any]) -> tuple[jax.Array | None, dict[str, Any]]:
        keep = _LAST_SELECTION.get(Ellipsis)
        if keep is Ellipsis:
            raise ValueError("an 'mla_dsa_shared' layer needs an 'mla_dsa' layer before it in the same forward pass")
        return keep, state
