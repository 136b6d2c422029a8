"""Model quality measured the same way everywhere: mean next-token negative log-likelihood
(perplexity = exp of it) of a loaded model over held-out token ids, in non-overlapping
windows (the quantised-expert test and `scripts/bench_quant.py` use it)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def held_out_nll(model, ids: Sequence[int], window: int = 256) -> float:
    """Mean negative log-likelihood of ids[1:] given their prefixes within each window of
    `window` predicted tokens (logits from `model.logits`, computed in float64)."""
    ids = list(ids)
    if len(ids) <= window:
        raise ValueError(f"need more than {window} ids for one window, got {len(ids)}")
    total, count = 0.0, 0
    for start in range(0, len(ids) - window, window):
        w = ids[start:start + window + 1]
        logits = model.logits(w[:-1]).astype(np.float64)  # [T, V]
        top = logits.max(-1)
        lse = np.log(np.exp(logits - top[:, None]).sum(-1)) + top
        total += float((lse - logits[np.arange(window), w[1:]]).sum())
        count += window
    return total / count
