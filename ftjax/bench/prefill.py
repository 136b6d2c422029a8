"""Prefill measurements: the streamed path's overlap, and the cached-vs-streamed crossover.

`prefill_breakdown(model, ids)` times a streamed prefill three ways: T_prefill
(pipelined), T_transfer (the sends alone) and T_compute (compute alone, blocks
preloaded). The paper's claim is T_prefill ~ max(T_transfer, T_compute), i.e. a ratio near
1 (2 would mean no overlap at all when both are equal). `prefill_overlap` takes medians
over a few calls and times the cached (non-streamed) path on the same prompt for
comparison when the model uses it.

`calibrate_prefill(model)` measures cached vs streamed prefill per prompt bucket on this
machine and sets `model.stream_threshold` to the smallest bucket from which streaming
stays faster (what `prefill="auto"` uses on an accelerator).
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import jax
import numpy as np

from ftjax.engine.session import MIN_PROMPT_BUCKET, bucket
from ftjax.engine.telemetry import Telemetry

NOT_AVAILABLE = "not available in this build"


def _streamed_inputs(model, ids: np.ndarray):
    if model._streamed is None:
        raise ValueError(f"policy {model.policy!r} keeps every expert on the device: nothing to stream")
    T = ids.size
    tokens = np.zeros((1, bucket(T)), np.int32)
    tokens[0, :T] = ids
    return tokens, np.zeros(1, np.int32), np.array([T], np.int32), bucket(T)


def prefill_breakdown(model, ids: Sequence[int]) -> dict[str, float]:
    """Streamed prefill of `ids` from an empty state: T_prefill, T_transfer, T_compute."""
    arr = model._check_prompt(ids)
    tokens, start, length, cap = _streamed_inputs(model, arr)
    return model._streamed.breakdown(model._params, lambda: model.new_state(1, cap), model._xstate,
                                     model.checkpoint.pool, tokens, start, length)


def prefill_overlap(model, ids: Sequence[int], repeats: int = 3) -> dict:
    try:
        runs = [prefill_breakdown(model, ids) for _ in range(repeats)]
    except Exception as e:  # a policy whose streamed path refuses this model
        return {"available": False, "reason": f"prefill_breakdown failed: {type(e).__name__}: {e}"}
    out = {k: statistics.median(r[k] for r in runs) for k in ("t_prefill_s", "t_transfer_s", "t_compute_s")}
    out["overlap_ratio"] = out["t_prefill_s"] / max(out["t_transfer_s"], out["t_compute_s"])
    out["serial_ratio"] = out["t_prefill_s"] / (out["t_transfer_s"] + out["t_compute_s"])
    out.update(available=True, tokens=len(ids), repeats=repeats, bytes_sent=runs[0].get("bytes_sent"),
               samples=runs)
    if out.get("bytes_sent"):
        out["transfer_gbps"] = out["bytes_sent"] / out["t_transfer_s"] / 1e9
    if getattr(model, "prefill_mode", None) == "cached":
        times = []
        for _ in range(repeats + 1):  # the first call compiles
            model.generate(ids, 1)
            times.append(model.last_generation.ttft_s)
        out["t_cached_prefill_s"] = statistics.median(times[1:])
    return out


def calibrate_prefill(model, max_tokens: int = 512, repeats: int = 3, seed: int = 0) -> dict:
    """Cached vs streamed prefill time per prompt bucket; sets `model.stream_threshold`.
    Every run starts from a cold expert cache (as a new prompt would), and the cache is
    cleared at the end. Returns {"threshold", "buckets": [{"tokens", "cached_s", "streamed_s"}]}."""
    if model._streamed is None:
        raise ValueError(f"policy {model.policy!r} keeps every expert on the device: nothing to stream")
    rng = np.random.default_rng(seed)
    mode, rows, telemetry = model.prefill_mode, [], model._telemetry
    model._telemetry = Telemetry(keep_records=0)  # calibration leaves no records
    n = MIN_PROMPT_BUCKET
    try:
        while n <= min(max_tokens, model.max_seq_len - 1):
            ids = rng.integers(0, model.config.vocab_size, n).astype(np.int32)
            row = {"tokens": n}
            for path in ("cached", "streamed"):
                model.prefill_mode = path
                times = []
                for _ in range(repeats + 1):  # the first run compiles
                    model.clear_expert_cache()
                    t0 = time.perf_counter()
                    jax.block_until_ready(model.session().append(ids))
                    times.append(time.perf_counter() - t0)
                row[f"{path}_s"] = float(np.median(times[1:]))
            rows.append(row)
            n *= 2
    finally:
        model.prefill_mode, model._telemetry = mode, telemetry
        model.clear_expert_cache()
    faster = [r["streamed_s"] < r["cached_s"] for r in rows]
    wins = [i for i in range(len(rows)) if all(faster[i:])]
    model.stream_threshold = rows[wins[0]]["tokens"] if wins else model.max_seq_len
    return {"threshold": model.stream_threshold, "buckets": rows}
