"""Decode throughput: simulated per machine and policy, and the simulator checked against
measured runs on this machine.

Simulated (`simulate_grid`): `lab.simulate_decode` replays each policy on a trace with
each machine's (B_P, B_H) and sums the layer-time model. Two geometries:
  - the loaded model, on its own recorded decode traces, at a fixed cache fraction
    (the whole pool of a small model fits any GPU, so a fraction stands in for "too big");
  - Qwen3-30B-A3B (48 x 128 experts, top-8) on synthetic traces whose temporal
    locality and popularity skew are fitted to the recorded traces (no 30B model runs
    here), in two workloads that bracket real drift: "stationary" (the timed tokens
    share the warm-up's expert popularity, static-frequency's best case) and "drift"
    (the timed tokens come from a fresh popularity draw: a new topic, its worst case);
    cache = what fits each GPU's VRAM after the non-expert weights and 2 GiB.

Validation (`measure_runs`, `validate`): `ftjax.load(policy=p, cache_slots=s)` decodes
the same prompt for each run (a warm-up generation first compiles everything; each
timed generation starts from a cleared cache), runs interleaved over a few rounds;
tok/s = 1 / (median over rounds of the mean per-token wall time). The run's own
expert log is replayed by `simulate_decode` with this machine's measured profile. One
constant is calibrated on the FIRST run only: a per-token overhead = measured -
predicted mean step time (dispatch, attention, sampling, bookkeeping: what the
bandwidth model leaves out). The other runs are predictions.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Sequence

import numpy as np

import ftjax
from ftjax.lab.geometry import ModelGeometry
from ftjax.lab.machines import HardwareProfile
from ftjax.lab.simulator import simulate_decode
from ftjax.lab.synthetic import synthetic_trace
from ftjax.lab.trace import Trace

from ftjax.bench.traces import generate, trace_of

SIM_POLICIES = ("lru", "reuse-rate", "lru-transfer-only", "lru-host-only", "static-frequency", "static-layer")
QWEN_POLICIES = ("lru", "reuse-rate", "lru-transfer-only", "static-frequency", "static-layer")
BASELINES = ("static-frequency", "static-layer")  # KTransformers-like, llama.cpp-like


# ---------------------------------------------------------------------------- simulated


def simulate_grid(geometry_name: str, trace: Trace, geometry: ModelGeometry, machines: dict[str, HardwareProfile],
                  slots_of: dict[str, int], *, profile: Trace | None, warmup_tokens: int,
                  policies: Sequence[str] = SIM_POLICIES) -> list[dict]:
    rows = []
    for name, hw in machines.items():
        for policy in policies:
            r = simulate_decode(trace, policy, slots_of[name], hw, geometry, warmup_tokens=warmup_tokens,
                                profile=profile)
            rows.append({"geometry": geometry_name, "machine": name, "policy": policy, "slots": r["slots"],
                         "cache_fraction": r["cache_fraction"], "tok_per_s": r["tok_per_s"],
                         "miss_rate": r["miss_rate"], "fetched": r["fetched"], "host_computed": r["host_computed"],
                         "num_tokens": r["num_tokens"]})
    return rows


def speedups(rows: Sequence[dict], ours: str = "lru") -> list[dict]:
    """tok/s of `ours` over the best static baseline, per (geometry, machine)."""
    out = []
    keys = dict.fromkeys((r["geometry"], r["machine"]) for r in rows)
    for geo, machine in keys:
        v = {r["policy"]: r for r in rows if r["geometry"] == geo and r["machine"] == machine}
        if ours not in v or not any(b in v for b in BASELINES):
            continue
        best = max((b for b in BASELINES if b in v), key=lambda b: v[b]["tok_per_s"])
        out.append({"geometry": geo, "machine": machine, "ours": ours, "ours_tok_per_s": v[ours]["tok_per_s"],
                    "best_baseline": best, "baseline_tok_per_s": v[best]["tok_per_s"],
                    "speedup": v[ours]["tok_per_s"] / v[best]["tok_per_s"] if v[best]["tok_per_s"] else float("nan"),
                    "cache_fraction": v[ours]["cache_fraction"]})
    return out


def matched_synthetic(geometry: ModelGeometry, reuse: float, chance: float, zipf_s: float, num_tokens: int,
                      seed: int = 0) -> Trace:
    """A synthetic trace with this geometry and the measured excess reuse of real traces:
    reuse ~ locality + (1 - locality) * chance  =>  locality = (reuse - chance) / (1 - chance)."""
    loc = float(np.clip((reuse - chance) / max(1e-9, 1 - chance), 0.0, 0.95))
    t = synthetic_trace(geometry.num_moe_layers, geometry.num_experts, geometry.top_k, num_tokens, loc, seed,
                        zipf_s=zipf_s)
    t.meta.update({"fitted_locality": loc, "fitted_zipf_s": zipf_s, "source_reuse": reuse, "source_chance": chance})
    return t


# ---------------------------------------------------------------------------- measured


@dataclasses.dataclass(frozen=True)
class Run:
    policy: str  # runtime policy name
    fraction: float  # cache slots / (Lm * E); ignored by "host" and "device"

    def lab_policy(self) -> str:
        return {"host": "lru-host-only", "device": "static-layer"}.get(self.policy, self.policy)

    def slots(self, total: int) -> int:
        if self.policy == "host":
            return 0
        if self.policy == "device":
            return total
        return max(1, int(round(self.fraction * total)))


def load_model(path, policy: str, slots: int, *, threads: int | None, bandwidth=None, frequency=None):
    """ftjax.load with the decode cache filled by prefill too ("cached" prefill, where the
    build offers the option), so every record of the log went through the LRU rules."""
    kw: dict = {"policy": policy, "threads": threads}
    if policy not in ("host", "device"):
        kw["cache_slots"] = slots
    if policy == "lru":
        kw["bandwidth"] = bandwidth
    if policy == "static-frequency":
        kw["frequency"] = frequency
    if "prefill" in inspect.signature(ftjax.load).parameters:
        kw["prefill"] = "cached"
    return ftjax.load(path, **kw)


def measure_runs(models: list[tuple[Run, object]], prompt: Sequence[int], num_tokens: int, cache_len: int,
                 rounds: int, warm: set[int] = frozenset()) -> list[dict]:
    """Decode `prompt` on every model, cold cache each time, in `rounds` interleaved rounds
    (so load from other processes hits every run alike). Models whose index is not in
    `warm` first run one untimed generation (compiles). Per run: per-token time = median
    over rounds of the round's mean; the trace is the last round's (every round routes and
    caches identically: greedy decode, cleared cache)."""
    for i, (_, model) in enumerate(models):
        if i not in warm:
            generate(model, prompt, num_tokens, cache_len)
    per_round: list[list[np.ndarray]] = [[] for _ in models]
    out: list[dict] = [{} for _ in models]
    for _ in range(rounds):
        for i, (_, model) in enumerate(models):
            model.clear_expert_cache()
            model.reset_stats()
            g = generate(model, prompt, num_tokens, cache_len)
            per_round[i].append(np.asarray(g.token_s))
            decode = [r for r in model.expert_log() if r["phase"] == "decode"]
            selections = sum(len(r["selected"]) for r in decode)
            misses = sum(len(r["fetched"]) + len(r["host"]) for r in decode)
            out[i] = {"tokens": len(g.tokens), "trace": trace_of(model, {"kind": "validation"}),
                      "decode_miss_rate": misses / selections if selections else 0.0}
    for i, times in enumerate(per_round):
        means = [float(t.mean()) for t in times if t.size]
        step_s = float(np.median(means)) if means else float("nan")
        out[i].update(step_s=step_s, round_step_s=means, measured_tok_per_s=1.0 / step_s,
                      measured_median_tok_per_s=1.0 / float(np.median(np.concatenate(times))))
    return out


def predict(run: Run, measured: dict, hw: HardwareProfile, geometry: ModelGeometry, context: int,
            profile: Trace | None) -> dict:
    slots = run.slots(geometry.num_expert_slots_total)
    return simulate_decode(measured["trace"], run.lab_policy(), slots, hw, geometry, context_tokens=context,
                           warmup_prefill=True, profile=profile)


def validate(measured: list[tuple[Run, dict]], hw: HardwareProfile, geometry: ModelGeometry, context: int,
             profile: Trace | None) -> tuple[list[dict], HardwareProfile]:
    """Calibrate the per-token overhead on measured[0], predict every run, relative errors."""
    cal_run, cal = measured[0]
    raw = predict(cal_run, cal, hw, geometry, context, profile)
    gap = cal["step_s"] - float(np.mean(raw["per_token_s"]))
    hw_cal = dataclasses.replace(hw, per_token_overhead_s=max(0.0, gap))
    rows = []
    for i, (run, m) in enumerate(measured):
        p = predict(run, m, hw_cal, geometry, context, profile)
        modelled = 1.0 - hw_cal.per_token_overhead_s / float(np.mean(p["per_token_s"]))
        pred_tps = p["tok_per_s"]
        meas_tps = m["measured_tok_per_s"]
        rows.append({"policy": run.policy, "lab_policy": run.lab_policy(), "slots": p["slots"],
                     "cache_fraction": p["cache_fraction"], "calibration": i == 0, "tokens": m["tokens"],
                     "measured_tok_per_s": meas_tps, "measured_median_tok_per_s": m["measured_median_tok_per_s"],
                     "predicted_tok_per_s": pred_tps, "rel_err": (pred_tps - meas_tps) / meas_tps,
                     "predicted_miss_rate": p["miss_rate"],
                     "runtime_miss_rate": m["decode_miss_rate"],
                     "measured_step_s": m["step_s"], "predicted_step_s": float(np.mean(p["per_token_s"])),
                     "round_tok_per_s": [1.0 / t for t in m["round_step_s"]],
                     "modelled_share": modelled})
    return rows, hw_cal

