"""Token sampling inside the jitted step: greedy, or seeded temperature / top-k / top-p.

The sampling settings are traced scalars, so changing them never recompiles; greedy
(temperature 0) is a branch of the same program. The key for step i of a
row is fold_in(PRNGKey(seed), i), so a seeded run is reproducible token for token, alone
or in a batch.

Per-row logit bias (OpenAI's `logit_bias`, and banned tokens as -inf: `tool_choice:
"none"` bans `<tool_call>`) is applied to the logits before any of this, inside the
step, so a banned token is never drawn and a sampled row samples from what is left. It
travels sparse, `ids [B, K]` / `values [B, K]` with K a bucket of at least
`MIN_BIAS_SLOTS` (padding ids = V, dropped), so most requests share one program.

A request's first token comes from its prompt's logits, before it joins the decode
batch: a greedy one is taken on the host (`greedy_token`, equal to the program's argmax
with the bias), a sampled one by `session._first_tokens`. With the key data made in numpy
too (`key_data`), a greedy request's first token runs no program of its own (in a
restarted process, tracing, lowering and reading back that program and the eager ones
before it took ~0.1 s of a 2,000-token prompt's first token on the embedded model).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MIN_BIAS_SLOTS = 8


def bias_arrays(rows: list[dict[int, float] | None], vocab_size: int, batch: int | None = None):
    """Per-row {token: bias} (None: none) -> (ids [B, K] int32, values [B, K] f32), padded
    to `batch` rows and K = the next power of two >= the longest row (>= MIN_BIAS_SLOTS);
    padding ids are `vocab_size` (out of range: dropped by `apply_bias`)."""
    B = batch or len(rows)
    longest = max((len(r) for r in rows if r), default=0)
    K = max(MIN_BIAS_SLOTS, 1 << max(longest - 1, 0).bit_length())
    ids = np.full((B, K), vocab_size, np.int32)
    values = np.zeros((B, K), np.float32)
    for b, row in enumerate(rows):
        if row:
            ids[b, :len(row)] = list(row)
            values[b, :len(row)] = list(row.values())
    return ids, values


def key_data(seed: int) -> np.ndarray:
    """`jax.random.PRNGKey(seed)` as host data [2] uint32, computed in numpy where JAX's
    rule is plain (threefry2x32 with 32-bit integers: [0, seed mod 2**32]), so a request
    costs no eager program (in a restarted process each one is traced, lowered and read
    back from the compilation cache); JAX itself otherwise."""
    if jax.config.jax_enable_x64 or jax.config.jax_default_prng_impl != "threefry2x32":
        return np.asarray(jax.random.PRNGKey(seed))
    return np.array([0, int(seed) & 0xFFFFFFFF], np.uint32)


def greedy_token(logits: np.ndarray, bias: dict[int, float] | None) -> int | None:
    """The token `sample` gives a greedy row, on the host: argmax of logits [V] f32 plus
    the bias (`apply_bias`: ids outside the vocabulary dropped) -> its id; None when a
    bias id is negative (JAX's indexing would wrap it: left to the program)."""
    if bias:
        ids = np.fromiter(bias.keys(), np.int64, len(bias))
        if (ids < 0).any():
            return None
        keep = ids < logits.shape[-1]
        logits = logits.copy()
        logits[ids[keep]] += np.fromiter(bias.values(), np.float32, len(bias))[keep]  # ids are unique (dict keys)
    return int(np.argmax(logits))


def apply_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """logits [B, V] + values [B, K] at ids [B, K] (ids out of range are dropped)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, ids].add(values, mode="drop")


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits [B, V] f32 -> token ids [B] int32, each row with its own key [B] and settings
    (temperature / top_k / top_p [B], or scalars for every row). top_k 0 = off; top_p 1.0
    = off; temperature 0 = greedy. The stochastic branch (a sort over V) runs only when
    some row samples."""
    B = logits.shape[0]
    temperature, top_k, top_p = (jnp.broadcast_to(jnp.asarray(v), (B,)) for v in (temperature, top_k, top_p))
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def stochastic(_):
        drawn = jax.vmap(_sample_row)(logits, keys, temperature, top_k, top_p)
        return jnp.where(temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda _: greedy, None)


def _sample_row(logits, key, temperature, top_k, top_p):
    """One row: logits [V] -> token id []."""
    scaled = logits / jnp.maximum(temperature, 1e-6)
    sorted_desc = jnp.sort(scaled)[::-1]  # [V]
    V = logits.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = sorted_desc[k - 1]
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    # top-p: keep the smallest prefix of the sorted distribution with mass >= top_p
    probs_sorted = jax.nn.softmax(jnp.where(sorted_desc < kth, -jnp.inf, sorted_desc))
    mass_before = jnp.cumsum(probs_sorted) - probs_sorted
    cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_desc, jnp.inf))
    scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    return jax.random.categorical(key, scaled).astype(jnp.int32)
