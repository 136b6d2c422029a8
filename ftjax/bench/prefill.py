"""Prefill overlap: is streamed prefill close to max(T_transfer, T_compute)?

Uses `Model.prefill_breakdown(ids)` where the build has it (streamed prefill: whole MoE
layers sent host->device, double buffered): T_prefill (pipelined), T_transfer (the
sends alone) and T_compute (compute alone, blocks preloaded). The paper's claim is
T_prefill ~ max(T_transfer, T_compute), i.e. a ratio near 1 (2 would mean no overlap
at all when both are equal). Medians over a few calls; the cached (non-streamed) path
is timed on the same prompt for comparison when the model offers it.
"""

from __future__ import annotations

import statistics
from typing import Sequence

NOT_AVAILABLE = "not available in this build"


def prefill_overlap(model, ids: Sequence[int], repeats: int = 3) -> dict:
    if not hasattr(model, "prefill_breakdown"):
        return {"available": False, "reason": NOT_AVAILABLE}
    try:
        runs = [model.prefill_breakdown(ids) for _ in range(repeats)]
    except Exception as e:  # a build whose streamed path refuses this model or policy
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
