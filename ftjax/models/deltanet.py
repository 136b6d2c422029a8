"""Gated DeltaNet: the linear-attention layer kind of Qwen3-Next and Qwen3.5/3.6-MoE.

A layer holds a fixed-size state instead of a KV cache, so its cost per token does not
grow with the context:

    conv   [B, K-1, C]    the last K-1 inputs of a causal depthwise convolution
                          (C = 2·Hk·dk + Hv·dv channels: q, k, v before the conv)
    ssm    [B, Hv, dk, dv] the recurrent memory S of the gated delta rule

Per token t (per value head; q, k L2-normalised, q scaled by dk^-1/2):

    S ← exp(g_t) · S                        (decay; g_t = -exp(A_log) · softplus(a_t + dt_bias) ≤ 0)
    S ← S + k_t ⊗ β_t (v_t − Sᵀ k_t)        (delta rule: write v_t at key k_t with rate β_t = σ(b_t))
    o_t = Sᵀ q_t

then o is RMS-normalised per head, gated by silu(z), and projected back to D.

Two forms of the same recurrence:
- `recurrent_delta_rule` — one step per token (`lax.scan`): the decode path (T = 1) and
  the test oracle.
- `chunked_delta_rule` — chunks of `CHUNK` tokens (the WY/UT form used by
  flash-linear-attention): inside a chunk everything is [c, c] matrix products (c = CHUNK)
  and one unit-triangular inverse; only the chunk-to-chunk state hand-off is sequential,
  so prefill costs O(T·c) and is linear in T.

Padding and idle rows: tokens with `valid = False` get β = 0 and g = 0, which leaves S
untouched, and the conv state is taken after each row's last valid token. Valid tokens
are a prefix of each row (prompt padding sits at the end), so a padded prefill or an
idle row in batched decode never changes the state.

Projection layouts: Qwen3.5 stores in_proj_qkv / in_proj_z / in_proj_b / in_proj_a;
Qwen3-Next stores in_proj_qkvz / in_proj_ba grouped per key head ([q, k, v, z] of each
key head's group). `DeltaNetConfig.fused_qkvz` picks which; the split into q, k, v, z, b,
a is a reshape of the activations, the weights are used as stored.

Letters as in `ftjax.models.common`, plus Hk / Hv key / value heads, dk / dv their head
dims, C conv channels, K conv width, r = Hv / Hk.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ftjax.config import ModelConfig
from ftjax.models.layers import layer_kind
from ftjax.models.ops import Step, linear, linear_param, param, rms_norm

CHUNK = 64  # tokens per chunk of the chunked form (as flash-linear-attention)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def recurrent_delta_rule(q, k, v, g, beta, state):
    """One step per token. q, k [B, T, Hv, dk] (normalised, q scaled); v [B, T, Hv, dv];
    g, beta [B, T, Hv]; state [B, Hv, dk, dv] -> out [B, T, Hv, dv] f32, state."""
    def step(S, inputs):
        q_t, k_t, v_t, g_t, b_t = inputs  # [B, Hv, dk] x2, [B, Hv, dv], [B, Hv] x2
        S = S * jnp.exp(g_t)[..., None, None]
        remembered = jnp.einsum("bhkv,bhk->bhv", S, k_t)
        S = S + k_t[..., :, None] * ((v_t - remembered) * b_t[..., None])[..., None, :]
        return S, jnp.einsum("bhkv,bhk->bhv", S, q_t)

    time_major = [jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta)]
    state, out = jax.lax.scan(step, state.astype(jnp.float32), time_major)
    return jnp.moveaxis(out, 0, 1), state


def chunked_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same recurrence, `chunk` tokens at a time (shapes as `recurrent_delta_rule`).

    Within a chunk (positions i, j; Γ_i = Σ_{t≤i} g_t, cumulative log decay):
        (I + L) U = β·v,  (I + L) W = β·k·exp(Γ)   with L_ij = β_i (k_i·k_j) exp(Γ_i − Γ_j), i > j
    (one inverse of I + L per chunk, `unit_lower_inverse`, serves both)
    then, with S the state entering the chunk,
        v'  = U − W S                              (what is still new after S)
        out = exp(Γ) q S + tril((q kᵀ) exp(Γ_i − Γ_j)) v'
        S   ← exp(Γ_last) S + (k exp(Γ_last − Γ))ᵀ v'
    """
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    f32 = lambda a: jnp.pad(a.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
    q, k, v, g, beta = (f32(a) for a in (q, k, v, g, beta))  # padding: k = v = 0, β = g = 0 -> no effect
    n = (T + pad) // chunk
    # [B, T, H, d] -> [B, H, n, c, d]
    blocks = lambda a: a.reshape(B, n, chunk, H, -1).transpose(0, 3, 1, 2, 4)  # noqa: E731
    q, k, v = blocks(q), blocks(k), blocks(v)
    g, beta = blocks(g)[..., 0], blocks(beta)[..., 0]  # [B, H, n, c]

    cum = jnp.cumsum(g, axis=-1)  # Γ
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))  # i >= j
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [B, H, n, c, c]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    inverse = unit_lower_inverse(jnp.where(strict, k_beta @ jnp.swapaxes(k, -1, -2) * decay, 0.0))  # (I + L)^-1
    u = inverse @ v_beta  # [B, H, n, c, dv]
    w = inverse @ (k_beta * jnp.exp(cum)[..., None])  # [B, H, n, c, dk]
    intra = (q @ jnp.swapaxes(k, -1, -2)) * decay  # [B, H, n, c, c], zero above the diagonal
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [B, H, n]

    def step(S, i):  # S [B, H, dk, dv]
        take = lambda a: a[:, :, i]  # noqa: E731
        fresh = take(u) - take(w) @ S  # [B, H, c, dv]
        out = take(q_decayed) @ S + take(intra) @ fresh
        S = S * take(chunk_decay)[..., None, None] + jnp.swapaxes(take(k_decayed), -1, -2) @ fresh
        return S, out

    state, out = jax.lax.scan(step, state.astype(jnp.float32), jnp.arange(n))  # out [n, B, H, c, dv]
    out = out.transpose(1, 0, 3, 2, 4).reshape(B, n * chunk, H, dv)
    return out[:, :T], state


def unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """(I + L)^-1 for strictly lower-triangular L [..., c, c], by forward substitution one
    row at a time (row i = e_i - L_i (I + L)^-1, rows below i still zero).

    Plain XLA ops instead of `lax.linalg.triangular_solve`: on the CPU backend that is a
    LAPACK FFI call that splits its batch over XLA's intra-op pool and waits; two such
    calls in flight at once (u and w of one chunk are independent) can take every pool
    thread and wait on each other forever — seen on this 2-core machine at 512+ tokens."""
    c = lower.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(c, dtype=lower.dtype), lower.shape)

    def row(i, inv):
        new = eye[..., i, :] - jnp.einsum("...j,...jk->...k", lower[..., i, :], inv)
        return jax.lax.dynamic_update_index_in_dim(inv, new, i, axis=-2)

    return jax.lax.fori_loop(0, c, row, jnp.zeros_like(lower))


def causal_conv(x: jax.Array, conv_state: jax.Array, weight: jax.Array, n_valid: jax.Array):
    """Depthwise causal convolution + silu, continuing from the previous inputs.

    x [B, T, C]; conv_state [B, K-1, C] (the K-1 inputs before this call); weight [C, 1, K]
    (HF Conv1d layout); n_valid [B] valid tokens per row -> out [B, T, C] f32, the new
    conv state (the K-1 inputs ending at each row's last valid token)."""
    B, T, C = x.shape
    K = weight.shape[-1]
    full = jnp.concatenate([conv_state.astype(jnp.float32), x.astype(jnp.float32)], axis=1)  # [B, K-1+T, C]
    w = weight[:, 0, :].astype(jnp.float32)  # [C, K]
    out = sum(full[:, j:j + T] * w[:, j] for j in range(K))
    new_state = jax.vmap(lambda f, s: jax.lax.dynamic_slice_in_dim(f, s, K - 1, axis=0))(full, n_valid)
    return jax.nn.silu(out), new_state


@layer_kind("gated_deltanet")
class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet token mixer (see the module docstring). Parameters:
    w_qkv [D, 2·Hk·dk + Hv·dv], w_z [D, Hv·dv], w_b / w_a [D, Hv] (Qwen3.5 layout), or
    w_qkvz / w_ba (Qwen3-Next's per-key-head grouping); conv_w [C, 1, K]; dt_bias, A_log [Hv];
    norm_w [dv]; w_out [Hv·dv, D]."""

    SEQ_AXES: dict[str, int] = {}  # conv and ssm summarise every token so far

    def __init__(self, cfg: ModelConfig, layer: int, dtype=jnp.float32, packed: bool = False):
        dn = cfg.deltanet
        if dn is None:
            raise ValueError(f"layer {layer} is gated_deltanet but the config has no linear-attention settings")
        D = cfg.d_model
        self.cfg, self.dn = cfg, dn
        key_dim, value_dim = dn.num_k_heads * dn.k_head_dim, dn.num_v_heads * dn.v_head_dim
        if dn.fused_qkvz:
            self.w_qkvz = linear_param(D, 2 * key_dim + 2 * value_dim, dtype, packed)
            self.w_ba = linear_param(D, 2 * dn.num_v_heads, dtype, packed)
        else:
            self.w_qkv = linear_param(D, 2 * key_dim + value_dim, dtype, packed)
            self.w_z = linear_param(D, value_dim, dtype, packed)
            self.w_b = linear_param(D, dn.num_v_heads, dtype, packed)
            self.w_a = linear_param(D, dn.num_v_heads, dtype, packed)
        self.conv_w = param((2 * key_dim + value_dim, 1, dn.conv_kernel), dtype)
        self.dt_bias = param((dn.num_v_heads,), dtype)
        self.A_log = param((dn.num_v_heads,), dtype)
        self.norm_w = nnx.Param(jnp.ones((dn.v_head_dim,), dtype))
        self.w_out = linear_param(value_dim, D, dtype, packed)

    # ---- state ------------------------------------------------------------------------
    @staticmethod
    def init_state(cfg: ModelConfig, layer: int, batch: int, max_len: int, dtype=jnp.float32) -> dict[str, Any]:
        """Fixed size whatever max_len; kept float32 whatever the KV dtype (it is small and
        accumulates over the whole conversation)."""
        dn = cfg.deltanet
        channels = 2 * dn.num_k_heads * dn.k_head_dim + dn.num_v_heads * dn.v_head_dim
        return {"conv": jnp.zeros((batch, dn.conv_kernel - 1, channels), jnp.float32),
                "ssm": jnp.zeros((batch, dn.num_v_heads, dn.k_head_dim, dn.v_head_dim), jnp.float32)}

    @staticmethod
    def resize_state(state: dict[str, Any], max_len: int) -> dict[str, Any]:
        return state  # no sequence axis

    # ---- forward ------------------------------------------------------------------------
    def _project(self, x: jax.Array):
        """x [B, T, D] -> mixed qkv [B, T, C] (conv input, channels [q | k | v]), z [B, T, Hv, dv],
        b, a [B, T, Hv]."""
        dn = self.dn
        B, T, _ = x.shape
        Hk, Hv, dk, dv = dn.num_k_heads, dn.num_v_heads, dn.k_head_dim, dn.v_head_dim
        r = Hv // Hk
        if dn.fused_qkvz:  # per key head: [q (dk), k (dk), v (r·dv), z (r·dv)]; [b (r), a (r)]
            qkvz = linear(x, self.w_qkvz[...]).reshape(B, T, Hk, 2 * dk + 2 * r * dv)
            q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
            ba = linear(x, self.w_ba[...]).reshape(B, T, Hk, 2 * r)
            b, a = ba[..., :r].reshape(B, T, Hv), ba[..., r:].reshape(B, T, Hv)
            mixed = jnp.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
            return mixed, z.reshape(B, T, Hv, dv), b, a
        mixed = linear(x, self.w_qkv[...])
        z = linear(x, self.w_z[...]).reshape(B, T, Hv, dv)
        return mixed, z, linear(x, self.w_b[...]), linear(x, self.w_a[...])

    def __call__(self, x: jax.Array, step: Step, state: dict[str, Any]):
        """x [B, T, D] -> out [B, T, D], state advanced by this call's valid tokens."""
        dn = self.dn
        B, T, _ = x.shape
        Hk, Hv, dk, dv = dn.num_k_heads, dn.num_v_heads, dn.k_head_dim, dn.v_head_dim
        mixed, z, b, a = self._project(x)
        valid = step.valid
        mixed, conv_state = causal_conv(mixed, state["conv"], self.conv_w[...], jnp.sum(valid, axis=1).astype(jnp.int32))
        q, k, v = jnp.split(mixed, [Hk * dk, 2 * Hk * dk], axis=-1)
        q = l2_normalize(q.reshape(B, T, Hk, dk)) * dk**-0.5
        k = l2_normalize(k.reshape(B, T, Hk, dk))
        q, k = jnp.repeat(q, Hv // Hk, axis=2), jnp.repeat(k, Hv // Hk, axis=2)  # [B, T, Hv, dk]
        v = v.reshape(B, T, Hv, dv)
        beta = jnp.where(valid[..., None], jax.nn.sigmoid(b.astype(jnp.float32)), 0.0)  # [B, T, Hv]
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        g = jnp.where(valid[..., None], g, 0.0)
        rule = recurrent_delta_rule if T == 1 else chunked_delta_rule
        out, ssm = rule(q, k, v, g, beta, state["ssm"])  # [B, T, Hv, dv]
        out = gated_rms_norm(out, z, self.norm_w[...], self.cfg.rms_norm_eps)
        out = linear(out.reshape(B, T, Hv * dv).astype(x.dtype), self.w_out[...])
        return out, {"conv": conv_state, "ssm": ssm}


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, scaled by `weight`, times silu(gate) (f32)."""
    return rms_norm(x.astype(jnp.float32), weight.astype(jnp.float32), eps) * jax.nn.silu(gate.astype(jnp.float32))
