"""Cache-policy lab on recorded traces, and the check that the lab's LRU is the runtime's.

Miss-rate curves (`policy_curves`): every lab policy replays the decode records of
every trace at every cache fraction, all from an EMPTY cache, transfer-only
(q = m, Belady may bypass). Static policies keep their pins, but a pin's first use
counts as a miss (the fill), exactly as a dynamic policy pays for its first fill, so
Belady (the offline optimum from an empty cache) bounds every row. The same static
rows with the pins preloaded for free (how KTransformers and llama.cpp run after
load) are kept beside them (`static_preloaded`); the paper table uses those.
static-frequency is profiled on the OTHER traces (leave-one-out): pins chosen from the
decode records of every trace except the one being scored.

Warm start (`warm_start`, the steady state the paper measures): every policy first
replays the last `warm_tokens` decode tokens of the same leave-one-out profile trace
(not counted), then the scored trace;
static policies have their pins (chosen from that profile) preloaded. All policies
have then seen the same history, none pays a cold start. Belady is not a strict bound
on the counted part there (it optimises warm-up and scored records together).

Pooled rows weight each trace by its decode selections (total misses / total selections).

`lru_check`: run the model with an LRU policy at one cache size, rebuild the trace
from its `expert_log()`, replay it with `lab.simulate_lru` and compare record by
record (`first_mismatch`) and the `stats()` counters with the replay's totals.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ftjax.lab.lru import first_mismatch, simulate_lru
from ftjax.lab.policies import POLICIES, frequency_pins, layer_pins, run_policy, slots_for
from ftjax.lab.trace import Trace

from ftjax.bench.traces import concat, generate, trace_of

POLICY_ORDER = ("belady", "reuse-rate", "lru", "lru-per-layer", "lfu", "static-frequency", "static-layer")


def _pins(name: str, trace: Trace, slots: int, profile: Trace) -> np.ndarray:
    if name == "static-frequency":
        return frequency_pins(profile, slots)
    return layer_pins(trace.num_layers, trace.num_experts, slots)


def trace_curve(trace: Trace, profile: Trace, fractions: Sequence[float],
                policies: Sequence[str] = POLICY_ORDER) -> list[dict]:
    """Rows {policy, cache_fraction, miss_rate, misses, selections, preloaded_misses} for one trace."""
    decode = trace.decode_only()
    flat = decode.flat_ids()
    rows = []
    for name in policies:
        for fraction in fractions:
            slots = slots_for(trace, fraction)
            result = run_policy(name, decode, slots, profile=profile)
            t = result.totals("decode")
            row = {"policy": name, "cache_fraction": float(fraction), "slots": slots,
                   "selections": t["selections"], "misses": t["misses"], "preloaded_misses": None}
            if POLICIES[name].kind == "static":
                used_pins = np.intersect1d(_pins(name, trace, slots, profile), flat).size
                row["preloaded_misses"] = t["misses"]
                row["misses"] = t["misses"] + int(used_pins)  # a pin's first use fills its slot
            row["miss_rate"] = row["misses"] / row["selections"] if row["selections"] else 0.0
            rows.append(row)
    return rows


def tail(trace: Trace, num_tokens: int) -> Trace:
    """The records of the last `num_tokens` steps."""
    steps = np.unique(trace.step)
    return trace if len(steps) <= num_tokens else trace.subset(trace.step >= steps[-num_tokens])


def warm_curve(trace: Trace, profile: Trace, fractions: Sequence[float],
               policies: Sequence[str] = POLICY_ORDER, warm_tokens: int = 256) -> list[dict]:
    """Rows {policy, cache_fraction, misses, selections}: the last `warm_tokens` steps of
    `profile` replayed first, not counted (static pins come from the whole profile)."""
    decode = trace.decode_only()
    warmup = tail(profile, warm_tokens)
    combined = concat([warmup, decode])
    start = len(warmup)
    rows = []
    for name in policies:
        for fraction in fractions:
            slots = slots_for(trace, fraction)
            steps = run_policy(name, combined, slots, profile=profile).steps[start:]
            misses = sum(len(s.fetched) + len(s.host) for s in steps)
            selections = misses + sum(len(s.hits) for s in steps)
            rows.append({"policy": name, "cache_fraction": float(fraction), "slots": slots,
                         "selections": selections, "misses": misses})
    return rows


def _pool(per_trace: dict[str, list[dict]], policies, fractions, key: str = "misses") -> list[dict]:
    out = []
    for name in policies:
        for fraction in fractions:
            rows = [r for rs in per_trace.values() for r in rs
                    if r["policy"] == name and r["cache_fraction"] == float(fraction)]
            if not rows or rows[0].get(key) is None:
                continue
            sel = sum(r["selections"] for r in rows)
            out.append({"policy": name, "cache_fraction": float(fraction),
                        "miss_rate": sum(r[key] for r in rows) / sel if sel else 0.0})
    return out


def policy_curves(traces: dict[str, Trace], fractions: Sequence[float],
                  policies: Sequence[str] = POLICY_ORDER, warm_tokens: int = 256, log=lambda m: None) -> dict:
    """Per-trace and pooled miss-rate curves (cold; and warm-started if `warm`);
    static-frequency profiled leave-one-out."""
    per_trace: dict[str, list[dict]] = {}
    per_trace_warm: dict[str, list[dict]] = {}
    profiles: dict[str, list[str]] = {}
    for name, trace in traces.items():
        others = [n for n in traces if n != name]
        profile = concat([traces[n].decode_only() for n in others]) if others else trace.decode_only()
        profiles[name] = others or [name]
        per_trace[name] = trace_curve(trace, profile, fractions, policies)
        if warm_tokens > 0 and others:
            per_trace_warm[name] = warm_curve(trace, profile, fractions, policies, warm_tokens)
        log(f"cache lab: {name} ({trace.decode_only().num_selections} decode selections) done")
    out = {"results": _pool(per_trace, policies, fractions),
           "static_preloaded": _pool(per_trace, policies, fractions, "preloaded_misses"),
           "per_trace": per_trace, "static_frequency_profiled_on": profiles}
    if per_trace_warm:
        out["warm_start"] = _pool(per_trace_warm, policies, fractions)
        out["per_trace_warm_start"] = per_trace_warm
    return out


def belady_violations(results: Sequence[dict], tol: float = 1e-12) -> list[str]:
    """Rows where some policy misses less than Belady at the same fraction (should be none)."""
    best = {r["cache_fraction"]: r["miss_rate"] for r in results if r["policy"] == "belady"}
    return [f"{r['policy']} at {r['cache_fraction']:g}: {r['miss_rate']:.4f} < belady {best[r['cache_fraction']]:.4f}"
            for r in results if r["policy"] != "belady" and r["cache_fraction"] in best
            and r["miss_rate"] < best[r["cache_fraction"]] - tol]


# ---------------------------------------------------------------------------- runtime check


def lru_check(model, prompts: Sequence[Sequence[int]], num_tokens: int, cache_len: int,
              lab_policy: str, bandwidth: tuple[float, float] | None) -> dict:
    """Run `prompts` (cache kept between them) and compare the runtime with simulate_lru."""
    model.clear_expert_cache()
    model.reset_stats()
    for prompt in prompts:
        generate(model, prompt, num_tokens, cache_len)
    log = [r for r in model.expert_log() if not r.get("streamed")]
    trace = trace_of(model, {})
    slots = model.stats()["cache_slots"]
    lab = simulate_lru(trace, slots, lab_policy, bandwidth)
    mismatch = first_mismatch(lab, log)
    live = model.stats()
    keys = ("selections", "hits", "misses", "fetched", "host_computed")
    counters = {k: {"runtime": int(live[k]), "lab": int(lab.totals()[k])} for k in keys}
    counters_equal = all(v["runtime"] == v["lab"] for v in counters.values())
    return {"policy": model.policy, "lab_policy": lab_policy, "bandwidth": bandwidth, "slots": slots,
            "records": len(log), "decode_records": int(sum(r["phase"] == "decode" for r in log)),
            "first_mismatch": mismatch, "counters": counters, "counters_equal": counters_equal,
            "passed": mismatch is None and counters_equal}
