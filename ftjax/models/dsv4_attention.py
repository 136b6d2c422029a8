"""DeepSeek-V4 attention: the three layer kinds of `deepseek_v4` (transformers'
`DeepseekV4Attention` with its compressors and lightning indexer).

Every kind is shared-KV multi-query attention: one key per token, which is also its
value (K = V), attended by all H query heads:

    q_lat = RMSNorm(x W_qa)                      [Rq]     (q_a_proj, q_a_norm)
    q_h   = rms(q_lat W_qb)_h                     [hd]     (q_b_proj, then an unweighted RMSNorm per head)
    kv    = RMSNorm(x W_kv)                       [hd]     (kv_proj, kv_norm)

RoPE rotates the trailing dr dims of each head over interleaved pairs (x0, x1), ... in
place (the layout is kept: K = V, so the values carry the rotation too, and the output's
rope dims are rotated back by the query's position before the output projection). The
softmax has a learned per-head sink logit (a column that takes probability mass and no
value). The output projection is grouped: the H·hd outputs form g groups, each projected
to o_lora_rank by its own matrix (o_a_proj, one [H·hd/g, o_lora_rank] block per group),
then mixed to D by o_b_proj.

Kinds (the keys each query sees; letters as in `ftjax.models.common`, m = the rate):
    dsv4_sliding  the `sliding_window` latest tokens (plain RoPE, `rope_theta`).
    dsv4_hca      those, plus one compressed entry per closed window of m' tokens
                  (heavily_compressed_attention): entry w = RMSNorm(Σ_j softmax_j(z_j + B_j)·c_j)
                  over the window's tokens j (c = x W_kv', z = x W_gate', B a learned
                  per-slot bias), rotated at the window's first position; visible to the
                  query at p once the window is closed ((w+1)·m <= p+1).
    dsv4_csa      the same with m = 4 and overlapping windows (compressed_sparse_attention):
                  each token projects to two series (2·hd), entry w pools the first series of
                  window w-1 with the second of window w (2m slots, one softmax); and only the
                  index_topk entries a lightning indexer scores highest are kept: the indexer
                  compresses its own keys (di wide) the same way, scores
                  Σ_h w_h·relu(q_h·k)·di^-1/2 with q = q_lat W_iqb (rotated), w = x W_w·Hi^-1/2,
                  and keeps the top k visible entries (ties: lower entries first; `dsa.top_k_keep`).
Compressed layers use the "compress" RoPE (compress_rope_theta, optionally YaRN with
attention factor 1) for the queries, the token keys and the entries alike.

State (every leaf batch-first, all of a fixed size per capacity: SEQ_AXES is empty, so
sessions, snapshots and batches carry each leaf whole, like a recurrent state):
    kv        [B, W, hd]       the ring of the window's keys (= values), W = sliding_window:
                               position p at row p mod W (`ftjax.models.layers`' ring helpers,
                               on a one-head view [B, 1, W, hd]). Decode writes the new key,
                               then attends the min(start + 1, W) rows in use; a chunk attends
                               [ring in position order | its own keys] with the window mask and
                               writes back its last W real keys; a row without valid tokens
                               leaves its ring as it is.
    comp      [B, N, hd]       entry n (closed at position (n+1)·m - 1) at row n, N = ceil(S/m)
                               for a capacity of S tokens (compressed kinds); resize_state grows
                               or trims N with the capacity
    idx_comp  [B, N, di]       the indexer's compressed keys, the same way (dsv4_csa)
    buf_kv, buf_gate [B, Lb, w]  the raw projections (kv, gate) of the Lb tokens before the
                               state's position (Lb = m, or 2m with overlap, w the projection
                               width): a window that closes in a later call pools them.
                               `idx_buf_kv` / `idx_buf_gate` likewise for the indexer.
Each call computes the entries of the windows that close inside it (at most T/m + 1 per
row: one gather of Lb rows each from [buffer | this call's rows]), writes them at their
entry rows, and keeps its last Lb raw rows (per row: up to its valid tokens) as the new
buffer, so prefill in any split, then decode, equals one full forward.

Bytes per token of context (V4-Flash geometry: hd 512, W 128, di 128, bf16 state): a
sliding layer holds a fixed 128 KiB (W rows) per row whatever the context; an HCA layer
adds hd·2/128 = 8 B per token, a CSA layer (hd + di)·2/4 = 320 B per token (the
per-token layout before this one held 1 KiB (kv) + 1 KiB (comp) [+ 256 B (idx_comp)]
per token in every layer). Attention reads the W window rows and the N entries.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ftjax.config import ModelConfig
from ftjax.models.dsa import top_k_keep
from ftjax.models.layers import (ATTENTION_BLOCK, layer_kind, resize_axis, ring_keys, ring_write_chunk,
                                 ring_write_one)
from ftjax.models.ops import RMSNorm, Step, linear, linear_param, param, rope_cos_sin

_MASKED = -1e30  # finite: a fully masked block must not turn the running max into NaN


# ---- small pure functions ----------------------------------------------------------------------

def unweighted_rms(x: jax.Array, eps: float) -> jax.Array:
    """RMS-normalise the last axis without a weight (transformers' DeepseekV4UnweightedRMSNorm)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def rope_tail(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, heads, d]: interleaved RoPE on the trailing dr = 2·cos.shape[-1] dims, in
    place (pairs (x0, x1), (x2, x3), ... of that slice), the leading dims unchanged.
    cos, sin [B, T, dr/2] (one angle per pair). (cos, -sin) undoes it."""
    dr = 2 * cos.shape[-1]
    nope, rot = x[..., :-dr], x[..., -dr:].astype(jnp.float32)
    even, odd = rot[..., 0::2], rot[..., 1::2]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.stack([even * c - odd * s, odd * c + even * s], axis=-1).reshape(rot.shape).astype(x.dtype)
    return jnp.concatenate([nope, out], axis=-1)


def rope_angles(positions: jax.Array, cfg: ModelConfig, compressed: bool) -> tuple[jax.Array, jax.Array]:
    """cos, sin [.., dr/2] at `positions`: the "main" RoPE (rope_theta) of sliding layers or
    the "compress" one (compress_rope_theta, YaRN if configured) of compressed layers."""
    v = cfg.dsv4
    theta, scaling = (v.compress_rope_theta, v.compress_rope_scaling) if compressed else (cfg.rope_theta, None)
    cos, sin = rope_cos_sin(positions, v.rope_dim, theta, scaling)
    return cos[..., :v.rope_dim // 2], sin[..., :v.rope_dim // 2]


def sink_attention(q: jax.Array, kv: jax.Array, positions: jax.Array, kv_len: jax.Array, window: int,
                   sinks: jax.Array, scale: float, entries: jax.Array | None = None,
                   entry_visible: jax.Array | None = None, block: int = ATTENTION_BLOCK,
                   kv_start: jax.Array | None = None) -> jax.Array:
    """Shared-KV attention with a sink, over a sliding window of the token keys plus
    (optionally) compressed entries.

    q [B, T, H, hd]; kv [B, S, hd] (keys = values); positions [B, T]; kv_len [B] keys in
    use; sinks [H]; entries [B, N, hd] with entry_visible [B, T, N]; kv_start [B] (optional):
    keys before it are not there (a ring's empty slots) -> [B, T, H, hd] f32. Positions
    are those of the keys' axis (a ring's caller passes them relative to its first key).
    The token keys are read one block at a time (running max and sum, blocks outside
    the window or past the keys in use skipped); the entries are one more block; the
    sink joins the normaliser last."""
    B, T, H, hd = q.shape
    S = kv.shape[1]
    block = block if S % block == 0 else S
    qf = q.astype(jnp.float32) * scale
    q_pos = positions[:, None, :, None]  # [B, 1, T, 1]
    stop = jnp.minimum((jnp.max(kv_len) + block - 1) // block, S // block)
    first = jnp.maximum(jnp.min(positions) - window + 1, 0) // block

    def update(carry, s, values):  # s [B, H, T, n] masked scores, values [B, n, hd]
        m, l, acc = carry
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        rescale = jnp.exp(m - m_new)
        return m_new, l * rescale + jnp.sum(p, axis=-1), acc * rescale[..., None] + jnp.einsum("bhts,bsd->bhtd", p, values)

    def attend_block(i, carry):
        kb = jax.lax.dynamic_slice_in_dim(kv, i * block, block, axis=1).astype(jnp.float32)  # [B, blk, hd]
        k_pos = i * block + jnp.arange(block, dtype=jnp.int32)
        kb = jnp.where((k_pos[None, :] < kv_len[:, None])[..., None], kb, 0.0)
        s = jnp.einsum("bthd,bsd->bhts", qf, kb)
        visible = (k_pos <= q_pos) & (k_pos > q_pos - window)
        if kv_start is not None:
            visible &= k_pos >= kv_start[:, None, None, None]
        return update(carry, jnp.where(visible, s, _MASKED), kb)

    def body(i, carry):
        return jax.lax.cond((i >= first) & (i < stop), attend_block, lambda i, c: c, i, carry)

    carry = (jnp.full((B, H, T), _MASKED, jnp.float32), jnp.zeros((B, H, T), jnp.float32),
             jnp.zeros((B, H, T, hd), jnp.float32))
    carry = jax.lax.fori_loop(0, S // block, body, carry)
    if entries is not None:
        ent = entries.astype(jnp.float32)
        s = jnp.einsum("bthd,bnd->bhtn", qf, ent)
        carry = update(carry, jnp.where(entry_visible[:, None], s, _MASKED), ent)
    m, l, acc = carry
    sink = sinks.astype(jnp.float32)[None, :, None]  # [1, H, 1]
    m_all = jnp.maximum(m, sink)
    rescale = jnp.exp(m - m_all)
    out = acc * rescale[..., None] / (l * rescale + jnp.exp(sink - m_all))[..., None]  # [B, H, T, hd]
    return out.transpose(0, 2, 1, 3)


def closing_offsets(start: jax.Array, T: int, rate: int) -> jax.Array:
    """Offsets j (into a call of T tokens from start [B]) of the tokens that close a window
    ((start + j + 1) % rate == 0), ascending -> [B, T // rate + 1] (some past T)."""
    j0 = (-(start + 1)) % rate  # [B]
    return j0[:, None] + rate * jnp.arange(T // rate + 1, dtype=jnp.int32)[None, :]


# ---- the compressor ------------------------------------------------------------------------------

class Compressor(nnx.Module):
    """Pools every closed window of `rate` tokens into one entry of `width` dims
    (transformers' DeepseekV4HCACompressor, or with `overlap` the CSA / indexer one).
    Checkpoint names `compressor.{kv_proj, gate_proj, position_bias, kv_norm}`."""

    def __init__(self, cfg: ModelConfig, width: int, rate: int, overlap: bool, dtype=jnp.float32,
                 packed: bool = False):
        out = 2 * width if overlap else width
        self.width, self.rate, self.overlap = width, rate, overlap
        self.w_kv = linear_param(cfg.d_model, out, dtype, packed)
        self.w_gate = linear_param(cfg.d_model, out, dtype, packed)
        self.position_bias = param((rate, out), jnp.float32)  # B [m, out]
        self.kv_norm = RMSNorm(width, cfg.rms_norm_eps, dtype)
        self.cfg = cfg

    @property
    def buffer_len(self) -> int:  # Lb: raw rows a later window may still pool
        return 2 * self.rate if self.overlap else self.rate

    def __call__(self, x: jax.Array, step: Step, state: dict[str, Any], prefix: str) -> dict[str, Any]:
        """Write the entries of the windows that close in this call (x [B, T, D]) into
        state[prefix + "comp"] (entry n at row n) and move the raw buffer on; returns the
        new state."""
        B, T, _ = x.shape
        m, Lb, w = self.rate, self.buffer_len, self.width
        kv_new, gate_new = linear(x, self.w_kv[...]), linear(x, self.w_gate[...])  # [B, T, out]
        ext_kv = jnp.concatenate([state[prefix + "buf_kv"].astype(kv_new.dtype), kv_new], axis=1)  # [B, Lb+T, out]
        ext_gate = jnp.concatenate([state[prefix + "buf_gate"].astype(gate_new.dtype), gate_new], axis=1)
        n_valid = jnp.sum(step.valid, axis=1).astype(jnp.int32)  # [B]: valid tokens form a prefix

        js = closing_offsets(step.start, T, m)  # [B, nW]
        closes = js < n_valid[:, None]
        rows = jnp.minimum(js[..., None] + 1 + jnp.arange(Lb)[None, None, :], Lb + T - 1)  # [B, nW, Lb]: ext indices
        pos = step.start[:, None, None] + js[..., None] - Lb + 1 + jnp.arange(Lb)[None, None, :]  # their positions
        take = jax.vmap(lambda a, r: a[r])  # [Lb+T, out], [nW, Lb] -> [nW, Lb, out]
        kv_rows = take(ext_kv, rows).astype(jnp.float32)
        gate_rows = take(ext_gate, rows).astype(jnp.float32) + self.position_bias[...].astype(jnp.float32)[pos % m]
        if self.overlap:  # slots: the previous window's first series, then this window's second
            kv_rows = jnp.concatenate([kv_rows[:, :, :m, :w], kv_rows[:, :, m:, w:]], axis=2)
            gate_rows = jnp.concatenate([gate_rows[:, :, :m, :w], gate_rows[:, :, m:, w:]], axis=2)
            gate_rows = jnp.where((pos >= 0)[..., None], gate_rows, -jnp.inf)  # window 0 has no previous one
        probs = jax.nn.softmax(gate_rows, axis=2)
        entries = self.kv_norm(jnp.sum(kv_rows * probs, axis=2))  # [B, nW, w]
        first = step.start[:, None] + js - m + 1  # each window's first position
        cos, sin = rope_angles(first, self.cfg, compressed=True)
        entries = rope_tail(entries[:, :, None], cos, sin)[:, :, 0]

        comp = state[prefix + "comp"]
        N = comp.shape[1]
        at = jnp.where(closes, (step.start[:, None] + js) // m, N)  # entry rows; N = dropped
        comp = comp.at[jnp.arange(B)[:, None], at].set(entries.astype(comp.dtype), mode="drop")
        keep = jax.vmap(lambda a, n: jax.lax.dynamic_slice_in_dim(a, n, Lb, axis=0))  # last Lb rows up to n_valid
        return {**state, prefix + "comp": comp,
                prefix + "buf_kv": keep(ext_kv, n_valid).astype(state[prefix + "buf_kv"].dtype),
                prefix + "buf_gate": keep(ext_gate, n_valid).astype(state[prefix + "buf_gate"].dtype)}


def entry_rows(max_len: int, rate: int) -> int:
    """Entry rows of a capacity of max_len tokens: ceil(max_len / rate) (the last one may
    not close inside it)."""
    return -(-max_len // rate)


def compressor_state(batch: int, max_len: int, dtype, prefix: str, width: int, rate: int,
                     overlap: bool) -> dict[str, jax.Array]:
    """Fresh leaves of one compressor: one row per entry and the raw buffer."""
    out, Lb = (2 * width, 2 * rate) if overlap else (width, rate)
    return {prefix + "comp": jnp.zeros((batch, entry_rows(max_len, rate), width), dtype),
            prefix + "buf_kv": jnp.zeros((batch, Lb, out), jnp.float32),
            prefix + "buf_gate": jnp.zeros((batch, Lb, out), jnp.float32)}


def resize_entries(state: dict[str, Any], max_len: int, prefix: str, overlap: bool) -> dict[str, Any]:
    """state with its prefix + "comp" leaf grown (zeros) or trimmed to entry_rows(max_len,
    rate); the rate is read off the raw buffer (Lb = rate, or 2·rate with overlap)."""
    Lb = state[prefix + "buf_kv"].shape[1]
    rate = Lb // 2 if overlap else Lb
    return {**state, prefix + "comp": resize_axis(state[prefix + "comp"], entry_rows(max_len, rate), axis=1)}


def entry_visible(positions: jax.Array, n: int, rate: int) -> jax.Array:
    """[B, T, n]: entry w is visible to the query at p once its window closed, (w+1)·rate <= p+1."""
    return jnp.arange(n)[None, None, :] < ((positions + 1) // rate)[:, :, None]


# ---- the layer kinds ------------------------------------------------------------------------------

@layer_kind("dsv4_sliding")
class SlidingAttention(nnx.Module):
    """Shared-KV sliding-window attention with a sink and a grouped output projection;
    state {"kv" [B, W, hd]}: the window's keys as a ring (see the module docstring), a
    fixed size whatever the context. Checkpoint names `self_attn.{q_a_proj, q_a_norm, q_b_proj,
    kv_proj, kv_norm, o_a_proj, o_b_proj, sinks}`."""

    SEQ_AXES: dict[str, int] = {}  # no per-token leaf: the ring and the entry rows are carried whole
    COMPRESSED = False

    def __init__(self, cfg: ModelConfig, layer: int, dtype=jnp.float32, packed: bool = False):
        v, D, H, hd = cfg.dsv4, cfg.d_model, cfg.num_heads, cfg.head_dim
        self.cfg = cfg
        self.w_q_a = linear_param(D, v.q_lora_rank, dtype, packed)
        self.q_a_norm = RMSNorm(v.q_lora_rank, cfg.rms_norm_eps, dtype)
        self.w_q_b = linear_param(v.q_lora_rank, H * hd, dtype, packed)
        self.w_kv = linear_param(D, hd, dtype, packed)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        self.w_o_a = linear_param(H * hd // v.o_groups, v.o_groups * v.o_lora_rank, dtype, packed)
        self.w_o_b = linear_param(v.o_groups * v.o_lora_rank, D, dtype, packed)
        self.sinks = param((H,), jnp.float32)

    # ---- state ------------------------------------------------------------------------
    @classmethod
    def init_state(cls, cfg: ModelConfig, layer: int, batch: int, max_len: int, dtype=jnp.float32) -> dict[str, Any]:
        return {"kv": jnp.zeros((batch, cfg.dsv4.sliding_window, cfg.head_dim), dtype)}

    @classmethod
    def resize_state(cls, state: dict[str, Any], max_len: int) -> dict[str, Any]:
        return state  # the ring does not depend on the capacity

    # ---- forward ------------------------------------------------------------------------
    def compressed(self, x: jax.Array, q_lat: jax.Array, step: Step, state: dict[str, Any]):
        """Hook of the compressed kinds: (entries [B, N, hd] or None, visible [B, T, N], state)."""
        return None, None, state

    def grouped_output(self, out: jax.Array) -> jax.Array:
        """out [B, T, H·hd] -> [B, T, D]: each of the g groups of H·hd/g through its own
        block of o_a_proj ([in, g·o_lora_rank] columns, or packed [g·o_lora_rank, in] rows),
        then o_b_proj."""
        v = self.cfg.dsv4
        g, r = v.o_groups, v.o_lora_rank
        B, T, _ = out.shape
        groups = out.reshape(B, T, g, -1)
        w = self.w_o_a[...]
        blocks = [w[j * r:(j + 1) * r] if w.dtype == jnp.uint16 else w[:, j * r:(j + 1) * r] for j in range(g)]
        mid = jnp.concatenate([linear(groups[:, :, j], blocks[j]) for j in range(g)], axis=-1)  # [B, T, g·r]
        return linear(mid, self.w_o_b[...])

    def __call__(self, x: jax.Array, step: Step, state: dict[str, Any]):
        """x [B, T, D] -> out [B, T, D], state with this call's keys (and entries) written."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, hd = cfg.num_heads, cfg.head_dim
        cos, sin = rope_angles(step.positions, cfg, self.COMPRESSED)
        q_lat = self.q_a_norm(linear(x, self.w_q_a[...]))  # [B, T, Rq]
        q = unweighted_rms(linear(q_lat, self.w_q_b[...]).reshape(B, T, H, hd), cfg.rms_norm_eps)
        q = rope_tail(q, cos, sin)
        kv = rope_tail(self.kv_norm(linear(x, self.w_kv[...]))[:, :, None], cos, sin)[:, :, 0]  # [B, T, hd]
        entries, visible, state = self.compressed(x, q_lat, step, state)
        W, sinks, scale = cfg.dsv4.sliding_window, self.sinks[...], hd ** -0.5
        ring = state["kv"][:, None]  # [B, 1, W, hd]: the layout of layers' ring helpers (one "head")
        if T == 1:  # the new key replaces position start - W, then the min(start + 1, W) rows in use
            ring = ring_write_one(ring, kv[:, None], step.start % W, step.valid[:, 0])
            q_pos = jnp.minimum(step.start, W - 1)  # every row in use visible, in any order
            out = sink_attention(q, ring[:, 0], q_pos[:, None], q_pos + 1, W, sinks, scale, entries, visible)
        else:  # [ring in position order | new keys]: index i holds position start - W + i
            keys = ring_keys(ring, kv[:, None], step.start)[:, 0]
            offset = step.start - W  # [B] position of key index 0
            out = sink_attention(q, keys, step.positions - offset[:, None], jnp.full((B,), W + T, jnp.int32), W,
                                 sinks, scale, entries, visible, kv_start=jnp.maximum(-offset, 0))
            ring = ring_write_chunk(ring, kv[:, None], step.start, step.valid)
        state = {**state, "kv": ring[:, 0]}
        out = rope_tail(out, cos, -sin).reshape(B, T, H * hd).astype(x.dtype)
        return self.grouped_output(out), state


@layer_kind("dsv4_hca")
class CompressedAttention(SlidingAttention):
    """Sliding window plus one compressed entry per closed window of hca_rate tokens;
    state {"kv", "comp", "buf_kv", "buf_gate"}."""

    COMPRESSED = True
    OVERLAP = False  # CSA: two series per token, windows overlapping by one

    def __init__(self, cfg: ModelConfig, layer: int, dtype=jnp.float32, packed: bool = False):
        super().__init__(cfg, layer, dtype, packed)
        self.compressor = Compressor(cfg, cfg.head_dim, self.rate(cfg), self.OVERLAP, dtype, packed)

    @staticmethod
    def rate(cfg: ModelConfig) -> int:
        return cfg.dsv4.hca_rate

    @classmethod
    def init_state(cls, cfg: ModelConfig, layer: int, batch: int, max_len: int, dtype=jnp.float32) -> dict[str, Any]:
        return {**SlidingAttention.init_state(cfg, layer, batch, max_len, dtype),
                **compressor_state(batch, max_len, dtype, "", cfg.head_dim, cls.rate(cfg), cls.OVERLAP)}

    @classmethod
    def resize_state(cls, state: dict[str, Any], max_len: int) -> dict[str, Any]:
        return resize_entries(state, max_len, "", cls.OVERLAP)

    def compressed(self, x, q_lat, step, state):
        state = self.compressor(x, step, state, "")
        entries = state["comp"]
        return entries, entry_visible(step.positions, entries.shape[1], self.compressor.rate), state


class Indexer(nnx.Module):
    """The lightning indexer of CSA layers: its own overlapping compressor (di wide) and
    the query / head-weight projections (checkpoint names `compressor.indexer.{kv_proj,
    gate_proj, position_bias, kv_norm, q_b_proj, scorer.weights_proj}`)."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, packed: bool = False):
        v = cfg.dsv4
        self.cfg = cfg
        self.compressor = Compressor(cfg, v.index_head_dim, v.csa_rate, True, dtype, packed)
        self.w_q_b = linear_param(v.q_lora_rank, v.index_n_heads * v.index_head_dim, dtype, packed)
        self.w_weights = linear_param(cfg.d_model, v.index_n_heads, dtype, packed)

    def keep(self, x: jax.Array, q_lat: jax.Array, step: Step, keys: jax.Array) -> jax.Array:
        """keep [B, T, N] bool: each query's top index_topk visible entries of keys [B, N, di]."""
        v = self.cfg.dsv4
        B, T, _ = x.shape
        N = keys.shape[1]
        visible = entry_visible(step.positions, N, v.csa_rate)
        k = min(v.index_topk, N)
        if k == N:  # static: every visible entry is kept
            return visible
        cos, sin = rope_angles(step.positions, self.cfg, compressed=True)
        q = rope_tail(linear(q_lat, self.w_q_b[...]).reshape(B, T, v.index_n_heads, v.index_head_dim), cos, sin)
        w = linear(x, self.w_weights[...]).astype(jnp.float32) * v.index_n_heads ** -0.5  # [B, T, Hi]
        s = jax.nn.relu(jnp.einsum("bthd,bnd->bthn", q.astype(jnp.float32), keys.astype(jnp.float32)))
        scores = jnp.einsum("bth,bthn->btn", w, s * v.index_head_dim ** -0.5)
        return top_k_keep(jnp.where(visible, scores, -jnp.inf), k) & visible


@layer_kind("dsv4_csa")
class SparseCompressedAttention(CompressedAttention):
    """Sliding window plus the indexer's top-k of the overlapping csa_rate entries; state
    {"kv", "comp", "buf_kv", "buf_gate", "idx_comp", "idx_buf_kv", "idx_buf_gate"}."""

    OVERLAP = True

    def __init__(self, cfg: ModelConfig, layer: int, dtype=jnp.float32, packed: bool = False):
        super().__init__(cfg, layer, dtype, packed)
        self.compressor.indexer = Indexer(cfg, dtype, packed)

    @staticmethod
    def rate(cfg: ModelConfig) -> int:
        return cfg.dsv4.csa_rate

    @classmethod
    def init_state(cls, cfg: ModelConfig, layer: int, batch: int, max_len: int, dtype=jnp.float32) -> dict[str, Any]:
        v = cfg.dsv4
        return {**super().init_state(cfg, layer, batch, max_len, dtype),
                **compressor_state(batch, max_len, dtype, "idx_", v.index_head_dim, v.csa_rate, True)}

    @classmethod
    def resize_state(cls, state: dict[str, Any], max_len: int) -> dict[str, Any]:
        return resize_entries(super().resize_state(state, max_len), max_len, "idx_", True)

    def compressed(self, x, q_lat, step, state):
        entries, visible, state = super().compressed(x, q_lat, step, state)
        indexer = self.compressor.indexer
        state = indexer.compressor(x, step, state, "idx_")
        return entries, indexer.keep(x, q_lat, step, state["idx_comp"]), state
