"""Synthetic routing traces with tunable temporal locality.

Used by the tests and as a demo when no real trace is at hand. The generator is a
two-part model of decode routing, per MoE layer:

  * popularity: each layer has a Zipf-like popularity over its experts,
    p(e) ~ 1 / rank(e)**zipf_s, with the ranks shuffled independently per layer;
  * locality: at each token each of the previous token's experts (same layer) is
    kept with probability `locality`; the remaining top_k - kept picks are drawn
    without replacement from the popularity (Gumbel top-k trick).

locality = 0 gives i.i.d. popular routing; locality = 1 repeats the first token
forever. Real models sit in between (Mixtral repeats its first choice 14-28% of
the time, see the FreeToken paper). Optionally one prefill record per layer is prepended:
the union of `prefill_tokens` routing draws, as a prefill chunk would select.
"""

from __future__ import annotations

import numpy as np

from ftjax.lab.trace import PHASES, Trace


def _zipf_log_popularity(rng, num_layers, num_experts, zipf_s):  # -> [L, E]
    ranks = np.stack([rng.permutation(num_experts) for _ in range(num_layers)])
    return -zipf_s * np.log1p(ranks)


def _draw(rng, log_pop, top_k, forced=None):  # -> [L, K] expert ids
    """Top-k of Gumbel-perturbed log popularity; `forced` [L, E] bool wins first."""
    scores = log_pop + rng.gumbel(size=log_pop.shape)
    if forced is not None:
        scores = np.where(forced, np.inf, scores)
    return np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]


def synthetic_trace(
    num_layers: int,
    num_experts: int,
    top_k: int,
    num_tokens: int,
    locality: float,
    seed: int = 0,
    *,
    zipf_s: float = 1.0,
    prefill_tokens: int = 0,
) -> Trace:
    """A decode trace of `num_tokens` tokens (records: token-major, layer-minor)."""
    if not 0 < top_k <= num_experts:
        raise ValueError("need 0 < top_k <= num_experts")
    rng = np.random.default_rng(seed)
    log_pop = _zipf_log_popularity(rng, num_layers, num_experts, zipf_s)
    rows = np.arange(num_layers)[:, None]

    records = []
    if prefill_tokens > 0:
        union = np.zeros((num_layers, num_experts), bool)
        for _ in range(prefill_tokens):
            union[rows, _draw(rng, log_pop, top_k)] = True
        for layer in range(num_layers):
            records.append((0, layer, "prefill", np.flatnonzero(union[layer])))

    prev = None  # [L, K]
    for token in range(num_tokens):
        forced = None
        if prev is not None:
            keep = rng.random(prev.shape) < locality
            forced = np.zeros((num_layers, num_experts), bool)
            forced[np.broadcast_to(rows, prev.shape)[keep], prev[keep]] = True
        prev = _draw(rng, log_pop, top_k, forced)
        for layer in range(num_layers):
            records.append((token, layer, "decode", np.sort(prev[layer])))

    lengths = [len(r[3]) for r in records]
    return Trace(
        num_layers=num_layers,
        num_experts=num_experts,
        step=np.array([r[0] for r in records], np.int64),
        layer=np.array([r[1] for r in records], np.int64),
        phase=np.array([PHASES.index(r[2]) for r in records], np.uint8),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        ids=np.concatenate([r[3] for r in records]).astype(np.int64)
        if records
        else np.zeros(0, np.int64),
        meta={
            "model": "synthetic",
            "top_k": top_k,
            "locality": locality,
            "zipf_s": zipf_s,
            "seed": seed,
            "prefill_tokens": prefill_tokens,
        },
    )
