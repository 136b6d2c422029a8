"""Layer kinds: the token-mixing part of a decoder layer, each owning its own state.

A decoder layer is (mixer, then dense MLP or MoE). The mixer is a *layer kind* picked
from `LAYER_KINDS` by name (`ModelConfig.layer_kind(i)`); the decoder never branches on
the kind. A kind is an `nnx.Module` class with

    init_state(cfg, layer, batch, max_len, dtype) -> state pytree   (every leaf: batch on axis 0)
    resize_state(state, max_len) -> state                     (grow or trim the capacity)
    SEQ_AXES {leaf name: axis}   the leaves that hold one entry per token (e.g. K and V,
                                 axis 2); every other leaf is a fixed-size summary of all
                                 tokens so far (a recurrent state)
    __call__(x [B, T, D], step: Step, state) -> (out [B, T, D], state)

so the session engine can create, grow, stack (batch), split, snapshot and restore any
kind's state without knowing what is inside; the state cache (`engine.state_cache`) cuts
the per-token leaves into segments between snapshots and keeps fixed leaves whole. Full attention's state is its KV cache;
a recurrent kind (Gated DeltaNet) or a latent cache (MLA) registers the same way.

Kinds
    attention   GQA attention over a preallocated KV cache {"k", "v"}: [B, G, S, hd]
                (`attend`: a C++ host kernel for decode on the CPU backend, else blocked XLA),
                written at each row's own `start` and read with a position mask (optional
                sliding window from the config), so prefill, decode and batched decode of
                sessions at different positions are one code path.
    sliding_attention  the same with a window W shorter than the context: K/V kept as
                a ring of W rows {"k", "v"}: [B, G, W, hd] (a fixed-size state).
    gated_attention  the same, with a sigmoid output gate from a double-width q_proj
                (Qwen3-Next, Qwen3.5).
    gated_deltanet   linear attention with a fixed-size recurrent state
                (`ftjax.models.deltanet`).
    mla         multi-head latent attention over a latent cache {"c_kv", "k_pe"}
                (DeepSeek-V3, `ftjax.models.mla`).
    mla_dsa     MLA plus the sparse-attention indexer and its own key cache
                {"c_kv", "k_pe", "idx_k"} (GLM-5, `ftjax.models.dsa`).
    dsv4_sliding, dsv4_hca, dsv4_csa   DeepSeek-V4's shared-KV attention with a sink: a sliding
                window, plus compressed entries (and the indexer's top-k of them); the window's
                keys as a ring (the ring helpers of sliding_attention), one row per compressed
                entry and fixed partial-window buffers (`ftjax.models.dsv4_attention`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ftjax import config, host
from ftjax.config import ModelConfig
from ftjax.models.ops import RMSNorm, Step, apply_rope, linear, linear_param, param

LAYER_KINDS: dict[str, type] = {}


def layer_kind(name: str):
    """Class decorator: register a layer kind under `name` (one of config.LAYER_KINDS)."""
    if name not in config.LAYER_KINDS:
        raise ValueError(f"layer kind {name!r} is not among ftjax.config.LAYER_KINDS: add it there")

    def register(cls):
        LAYER_KINDS[name] = cls
        cls.kind = name
        return cls
    return register


def kind_class(name: str) -> type:
    if name not in LAYER_KINDS:
        raise ValueError(f"unknown layer kind {name!r} (known: {', '.join(sorted(LAYER_KINDS))})")
    return LAYER_KINDS[name]


def attention_mask(q_pos: jax.Array, cache_len: int, window: int) -> jax.Array:
    """Boolean [B, T, S]: key at position s visible to the query at position q."""
    k_pos = jnp.arange(cache_len, dtype=jnp.int32)[None, None, :]
    q = q_pos[:, :, None]
    visible = k_pos <= q
    if window > 0:
        visible &= k_pos > q - window
    return visible


ATTENTION_BLOCK = 512  # keys per block: scores are [B, H, T, block], never [B, H, T, S]
_MASKED = -1e30  # finite: a fully masked block must not turn the running max into NaN


def blocked_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, positions: jax.Array,
                      kv_len: jax.Array, window: int = 0, block: int = ATTENTION_BLOCK,
                      kv_start: jax.Array | None = None) -> jax.Array:
    """Causal GQA attention over the cache prefix in use, one key block at a time with a
    running max and sum (flash-attention style): memory O(T x block), and only the blocks
    that hold keys of this call (up to max(kv_len)) are read, so the cost is the bytes in
    use, not the capacity (the others are skipped by a cond; the trip count stays static,
    so training can differentiate through it). Sliding windows skip the blocks before
    the window.

    q [B, T, H, hd]; cache_k / cache_v [B, G, S, hd] (head-major: each KV head's keys are
    one contiguous [S, hd] matrix, read once per block for all r = H/G query heads and T
    queries of its group); positions [B, T]; kv_len [B] keys in use per row (start + T);
    kv_start [B] (optional): keys before it are not there (a sliding-window ring's empty
    slots) -> out [B, T, H, hd] float32."""
    B, T, H, hd = q.shape
    G, S = cache_k.shape[1], cache_k.shape[2]
    r = H // G
    block = block if S % block == 0 else S
    q = q.astype(jnp.float32).reshape(B, T, G, r, hd).transpose(0, 2, 3, 1, 4).reshape(B, G, r * T, hd)
    q = q * hd**-0.5  # [B, G, Q = r*T, hd], query index = head-in-group * T + t
    q_pos = jnp.broadcast_to(positions[:, None, :], (B, r, T)).reshape(B, 1, r * T, 1)  # [B, 1, Q, 1]
    stop = jnp.minimum((jnp.max(kv_len) + block - 1) // block, S // block)
    first = 0
    if window > 0:  # no query of this call sees keys before min(positions) - window + 1
        first = jnp.maximum(jnp.min(positions) - window + 1, 0) // block

    def attend_block(i, carry):
        m, l, acc = carry  # [B, G, Q], [B, G, Q], [B, G, Q, hd]
        kb = jax.lax.dynamic_slice_in_dim(cache_k, i * block, block, axis=2).astype(jnp.float32)  # [B, G, blk, hd]
        vb = jax.lax.dynamic_slice_in_dim(cache_v, i * block, block, axis=2).astype(jnp.float32)
        k_pos = i * block + jnp.arange(block, dtype=jnp.int32)
        vb = jnp.where((k_pos[None, :] < kv_len[:, None])[:, None, :, None], vb, 0.0)  # rows past the keys in use
        s = jnp.einsum("bgqd,bgsd->bgqs", q, kb)  # [B, G, Q, blk]
        visible = k_pos <= q_pos
        if window > 0:
            visible &= k_pos > q_pos - window
        if kv_start is not None:
            visible &= k_pos >= kv_start[:, None, None, None]
        s = jnp.where(visible, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        scale = jnp.exp(m - m_new)
        l = l * scale + jnp.sum(p, axis=-1)
        acc = acc * scale[..., None] + jnp.einsum("bgqs,bgsd->bgqd", p, vb)
        return m_new, l, acc

    def body(i, carry):  # static trip count (differentiable); blocks outside [first, stop) are skipped
        return jax.lax.cond((i >= first) & (i < stop), attend_block, lambda i, c: c, i, carry)

    init = (jnp.full((B, G, r * T), _MASKED, jnp.float32), jnp.zeros((B, G, r * T), jnp.float32),
            jnp.zeros((B, G, r * T, hd), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, S // block, body, init)
    out = (acc / jnp.maximum(l, 1e-30)[..., None]).reshape(B, G, r, T, hd)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd)


HOST_KERNEL_DECODE = True  # decode attention through the host kernel on the CPU backend (benchmarks flip it)


def attend(q, cache_k, cache_v, positions, kv_len, window: int = 0) -> jax.Array:
    """Attention for a layer call. On the CPU backend: decode (T = 1) through the host
    kernel (`ftjax.host.attention`: reads each KV head's rows in use once for all its
    query heads; at 32k keys, per layer, bf16: 16 heads x 128 15 ms, GQA 32/4 8 ms vs
    19 ms for the XLA form), and prompt chunks on the AMX tiles where `dense_settings`
    grants them (numerics="fast" on an AMX CPU; `host.attention_takes_tiles`: about 10x
    the XLA form on a first chunk, 1.6-4x on one appended to a long history;
    scripts/bench_prompt_attention.py). Otherwise `blocked_attention` (XLA, any backend, f32)."""
    B, T, H, hd = q.shape
    if jax.default_backend() == "cpu":
        if (T == 1 and HOST_KERNEL_DECODE) or host.attention_takes_tiles(host.dense_isa(), T, hd):
            return host.attention(q, cache_k, cache_v, positions, kv_len, window)
    return blocked_attention(q, cache_k, cache_v, positions, kv_len, window)


def reference_attention(q, cache_k, cache_v, positions, window: int = 0) -> jax.Array:
    """The direct form (test oracle): one [B, H, T, S] score matrix over the whole cache.
    Caches [B, G, S, hd] as in `blocked_attention`."""
    B, T, H, hd = q.shape
    G, S = cache_k.shape[1], cache_k.shape[2]
    q = q.astype(jnp.float32).reshape(B, T, G, H // G, hd)
    scores = jnp.einsum("btgrd,bgsd->bgrts", q, cache_k.astype(jnp.float32)) * hd**-0.5  # [B, G, r, T, S]
    mask = attention_mask(positions, S, window)[:, None, None]  # [B, 1, 1, T, S]
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bgrts,bgsd->btgrd", probs, cache_v.astype(jnp.float32)).reshape(B, T, H, hd)


def write_rows(cache: jax.Array, new: jax.Array, start: jax.Array, axis: int = 1) -> jax.Array:
    """cache [B, ..., S (axis), ...] with new [B, ..., T, ...] written at row b from start[b]
    (in place when the cache is donated). One row: a dynamic_update_slice; several: the
    same, vmapped. A bf16 KV cache [B, G, S, hd] on the CPU backend goes through the host
    boundary's row write instead: XLA's CPU backend rewrites the whole bf16 cache around
    a bf16 dynamic-update-slice (widened to f32, or as a bitcast fused with the update),
    every step."""
    new = new.astype(cache.dtype)
    if cache.dtype == jnp.bfloat16 and axis == 2 and cache.ndim == 4 and jax.default_backend() == "cpu":
        return host.write_rows(cache, new, start)
    if cache.shape[0] == 1:
        return jax.lax.dynamic_update_slice_in_dim(cache, new, start[0], axis=axis)
    return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=axis - 1))(cache, new, start)


def resize_axis(a: jax.Array, size: int, axis: int) -> jax.Array:
    """Pad with zeros or trim `a` along `axis` to `size`."""
    n = a.shape[axis]
    if size <= n:
        return jax.lax.slice_in_dim(a, 0, size, axis=axis)
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, size - n)
    return jnp.pad(a, pad)


@layer_kind("attention")
class Attention(nnx.Module):
    """GQA attention with RoPE, optional q/k norms, biases, clipping and sliding window."""

    SEQ_AXES = {"k": 2, "v": 2}

    def __init__(self, cfg: ModelConfig, layer: int, dtype=jnp.float32, packed: bool = False):
        D, H, G, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg, self.window = cfg, cfg.sliding_windows[layer]
        self.wq = linear_param(D, H * hd, dtype, packed)
        self.wk, self.wv = linear_param(D, G * hd, dtype, packed), linear_param(D, G * hd, dtype, packed)
        self.wo = linear_param(H * hd, D, dtype, packed)
        if cfg.qkv_bias:
            self.bq, self.bk, self.bv = param((H * hd,), dtype), param((G * hd,), dtype), param((G * hd,), dtype)
        if cfg.o_bias:
            self.bo = param((D,), dtype)
        eps, offset = cfg.rms_norm_eps, cfg.norm_offset
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(hd, eps, dtype, offset), RMSNorm(hd, eps, dtype, offset)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(H * hd, eps, dtype, offset), RMSNorm(G * hd, eps, dtype, offset)

    # ---- state ------------------------------------------------------------------------
    @staticmethod
    def init_state(cfg: ModelConfig, layer: int, batch: int, max_len: int, dtype=jnp.float32) -> dict[str, Any]:
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)  # [B, G, S, hd]: head-major, read per block
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    @staticmethod
    def resize_state(state: dict[str, Any], max_len: int) -> dict[str, Any]:
        return {name: resize_axis(a, max_len, axis=2) for name, a in state.items()}

    # ---- forward ------------------------------------------------------------------------
    def _query(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """x [B, T, D] -> q [B, T, H*hd] (bias added), output gate (None: ungated)."""
        q = linear(x, self.wq[...])
        return (q + self.bq[...] if self.cfg.qkv_bias else q), None

    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        cfg = self.cfg
        q, gate = self._query(x)
        k, v = linear(x, self.wk[...]), linear(x, self.wv[...])  # [B, T, G*hd] x2
        if cfg.qkv_bias:
            k, v = k + self.bk[...], v + self.bv[...]
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
        return q, k, v, gate

    def _rotated(self, x: jax.Array, step: Step):
        """x [B, T, D] -> q [B, T, H, hd], k / v [B, G, T, hd] (RoPE applied), gate."""
        q, k, v, gate = self._project(x)
        cos, sin = step.rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), gate

    def _output(self, out: jax.Array, gate: jax.Array | None, dtype) -> jax.Array:
        """Attention output [B, T, H, hd] -> (gated) o_proj [B, T, D]."""
        B, T, H, hd = out.shape
        out = out.reshape(B, T, H * hd)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate.astype(jnp.float32))
        out = linear(out.astype(dtype), self.wo[...])
        return out + self.bo[...] if self.cfg.o_bias else out

    def __call__(self, x: jax.Array, step: Step, state: dict[str, Any]):
        """x [B, T, D] -> out [B, T, D], state with this call's keys/values written."""
        q, k, v, gate = self._rotated(x, step)
        state = {"k": write_rows(state["k"], k, step.start, axis=2), "v": write_rows(state["v"], v, step.start, axis=2)}
        out = attend(q, state["k"], state["v"], step.positions, step.start + q.shape[1], self.window)
        return self._output(out, gate, x.dtype), state


def ring_write_one(ring: jax.Array, new: jax.Array, slot: jax.Array, valid: jax.Array) -> jax.Array:
    """ring [B, G, W, hd] with new [B, G, 1, hd] at row slot[b] where valid[b] (other rows
    keep what they hold: an inactive batch row must not overwrite a key in its window)."""
    old = jax.vmap(lambda r, i: jax.lax.dynamic_slice_in_dim(r, i, 1, axis=1))(ring, slot)  # [B, G, 1, hd]
    return write_rows(ring, jnp.where(valid[:, None, None, None], new.astype(ring.dtype), old), slot, axis=2)


def ring_in_order(ring: jax.Array, start: jax.Array) -> jax.Array:
    """ring [B, G, W, hd] -> the same keys in position order: index i holds position
    start[b] - W + i (row (start - W + i) mod W)."""
    W = ring.shape[2]
    rows = (start[:, None] - W + jnp.arange(W)[None, :]) % W  # [B, W]
    return jax.vmap(lambda r, i: jnp.take(r, i, axis=1))(ring, rows)


def ring_keys(ring: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """A chunk's keys: [ring in position order | new] -> [B, G, W + T + pad, hd], index i
    holding position start[b] - W + i, padded to whole attention blocks (else one block of
    W + T) for `blocked_attention`; keys past W + T are padding."""
    S = ring.shape[2] + new.shape[2]
    pad = (-S) % ATTENTION_BLOCK if S > ATTENTION_BLOCK else 0
    keys = jnp.concatenate([ring_in_order(ring, start), new.astype(ring.dtype)], axis=2)
    return jnp.pad(keys, ((0, 0), (0, 0), (0, pad), (0, 0)))


def ring_write_chunk(ring: jax.Array, new: jax.Array, start: jax.Array, valid: jax.Array) -> jax.Array:
    """ring [B, G, W, hd] with the last W real rows of new [B, G, T, hd] (position
    start[b] + t at row (start + t) mod W). Padding rows and real rows more than W before
    the row's last are dropped: they would land on keys still in the window (and two
    writes to one row in one scatter have no defined order)."""
    W, T = ring.shape[2], new.shape[2]
    t = jnp.arange(T)[None, :]
    keep = valid & (t >= jnp.sum(valid, axis=1, keepdims=True) - W)  # [B, T]
    rows = jnp.where(keep, (start[:, None] + t) % W, W)  # W: out of range, dropped
    return jax.vmap(lambda r, i, n: r.at[:, i].set(n, mode="drop"))(ring, rows, new.astype(ring.dtype))


@layer_kind("sliding_attention")
class SlidingAttention(Attention):
    """Sliding-window attention that keeps only its window: K/V are a ring of W rows per
    KV head, position p at row p mod W, so memory and decode reads are O(W) whatever the
    context. `ModelConfig.layer_kind` picks it for an `attention` layer whose window is
    shorter than the model's context (otherwise the window never cuts anything).

    Decode (T = 1): the new key goes to row start mod W first (it replaces position
    start - W, the one key the new query no longer sees) and the query attends over the
    min(start + 1, W) rows in use, all visible: attention is a sum over keys, so their
    order in the ring does not matter (the host kernel reads them as any cache prefix).
    A chunk (T > 1): the ring read in position order (the W positions before start;
    ones before 0 masked by `kv_start`) followed by the T new keys, attended with the
    window mask; then the last W real keys are written to the ring.

    The ring summarises the tokens so far with no per-token axis (SEQ_AXES is empty),
    like a recurrent state: sessions, snapshots and batches carry it whole, capacity
    changes leave it as it is, and the state cache resumes such a model only where it
    saved a state."""

    SEQ_AXES: dict[str, int] = {}

    @staticmethod
    def init_state(cfg: ModelConfig, layer: int, batch: int, max_len: int, dtype=jnp.float32) -> dict[str, Any]:
        shape = (batch, cfg.num_kv_heads, cfg.sliding_windows[layer], cfg.head_dim)  # [B, G, W, hd]
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    @staticmethod
    def resize_state(state: dict[str, Any], max_len: int) -> dict[str, Any]:
        return state

    def __call__(self, x: jax.Array, step: Step, state: dict[str, Any]):
        W = self.window
        q, k, v, gate = self._rotated(x, step)
        B, T = q.shape[:2]
        if T == 1:
            slot = step.start % W
            state = {"k": ring_write_one(state["k"], k, slot, step.valid[:, 0]),
                     "v": ring_write_one(state["v"], v, slot, step.valid[:, 0])}
            out = attend(q, state["k"], state["v"], step.positions, jnp.minimum(step.start + 1, W))
            return self._output(out, gate, x.dtype), state
        offset = step.start - W  # [B] position of key index 0
        out = blocked_attention(q, ring_keys(state["k"], k, step.start), ring_keys(state["v"], v, step.start),
                                step.positions - offset[:, None], jnp.full((B,), W + T, jnp.int32), W,
                                kv_start=jnp.maximum(-offset, 0))
        state = {"k": ring_write_chunk(state["k"], k, step.start, step.valid),
                 "v": ring_write_chunk(state["v"], v, step.start, step.valid)}
        return self._output(out, gate, x.dtype), state


@layer_kind("gated_attention")
class GatedAttention(Attention):
    """Attention with a per-channel output gate (Qwen3-Next, Qwen3.5): q_proj is twice as
    wide, each head's rows [query (hd) | gate (hd)]; the attention output is multiplied by
    sigmoid(gate) before o_proj. State and everything else as `attention`."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype=jnp.float32, packed: bool = False):
        super().__init__(cfg, layer, dtype, packed)
        H, hd = cfg.num_heads, cfg.head_dim
        self.wq = linear_param(cfg.d_model, 2 * H * hd, dtype, packed)
        if cfg.qkv_bias:
            self.bq = param((2 * H * hd,), dtype)

    def _query(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        q = linear(x, self.wq[...])  # [B, T, H*2hd]
        if self.cfg.qkv_bias:
            q = q + self.bq[...]
        B, T, _ = x.shape
        H, hd = self.cfg.num_heads, self.cfg.head_dim
        q = q.reshape(B, T, H, 2 * hd)
        return q[..., :hd].reshape(B, T, H * hd), q[..., hd:].reshape(B, T, H * hd)
