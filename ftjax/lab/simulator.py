"""Decode-time model: seconds per MoE layer and tokens per second from a trace.

One MoE layer with `hits` resident experts and m misses of which q are transferred
(S = bytes of one expert, bandwidths in bytes/s):

    fill_s   = q S / B_P                               transfer of the q misses
    expert_s = max(S / B_dev, flops / device_flops)    one expert on the device
    device_s = fill_s + (hits + q) expert_s            one grouped expert call after the fill
    host_s   = (m - q) S / B_H' (+ host_sync_s if m > q) the other misses on the CPU
    layer_s  = per_layer_overhead_s + max(device_s, host_s)

B_H' is the CPU's expert bandwidth while the transfer runs. The paper's model:
the DMA reads the same DRAM, so the CPU keeps B_H - B_P while both paths are busy
and its full B_H when it runs alone; the transfer keeps B_P. That is our default;
measured concurrent bandwidths (`HardwareProfile.*_concurrent_gbps`, which the
runtime's profiler records) replace it.

A consequence worth knowing: under the paper's model q* = m B_P / B_H equalises
fill_s and host_s at m S / B_H -- exactly the host-only time. The split saves
nothing in the layer where it happens (rounding q and the device compute of the
q experts make it slightly worse, so `q_sweep`'s argmin is q = 0); it beats
transfer-only (m S / B_P) and pays off only through later hits on the q experts
it cached. Hybrid wins within the layer only where measured concurrent
bandwidths beat B_H - B_P (e.g. a compute-bound CPU kernel that leaves DRAM
bandwidth for the DMA).

One decode token (batch 1) at context c:

    token_s = per_token_overhead_s + (non_expert_bytes + c kv_bytes_per_token) / B_dev
              + sum over its MoE-layer records of layer_s

`simulate_decode` replays a policy on the trace to get hits / fetched / host per
record (LRU variants through `simulate_lru` with the machine's B_P / B_H, other
dynamic policies with the same bandwidth split, static policies host-only) and
sums the formula above. Every constant is a field of `HardwareProfile` or
`ModelGeometry`, so it can be calibrated against measured runs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ftjax.lab.geometry import ModelGeometry
from ftjax.lab.lru import LRU_POLICIES, fetch_count, fetch_rule, simulate_lru
from ftjax.lab.machines import HardwareProfile
from ftjax.lab.policies import POLICIES, run_policy
from ftjax.lab.trace import Trace

GB = 1e9
# one Qwen3-30B-A3B bf16 expert (3 * 2048 * 768 * 2 bytes) when no size is given
DEFAULT_EXPERT_BYTES = 3 * 2048 * 768 * 2


def layer_components(
    m: int,
    q: int,
    hits: int,
    expert_bytes: float,
    hw: HardwareProfile,
    expert_flops: float = 0.0,
) -> dict[str, float]:
    """The terms of one MoE layer's time (seconds); see the module docstring."""
    if not 0 <= q <= m:
        raise ValueError(f"need 0 <= q <= m, got q={q}, m={m}")
    both = 0 < q < m
    b_p = hw.b_p_gbps
    b_h = hw.b_h_gbps
    if both:
        b_p = hw.b_p_concurrent_gbps or b_p
        b_h = hw.b_h_concurrent_gbps or (hw.b_h_gbps - hw.b_p_gbps)

    expert_s = max(expert_bytes / (hw.device_mem_gbps * GB), expert_flops / (hw.device_tflops * 1e12))
    fill_s = q * expert_bytes / (b_p * GB)
    device_s = fill_s + (hits + q) * expert_s
    host_s = 0.0
    if m > q:
        host_s = (m - q) * expert_bytes / (b_h * GB) if b_h > 0 else float("inf")
        host_s += hw.host_sync_s
    overhead_s = hw.per_layer_overhead_s
    return {
        "fill_s": fill_s,
        "device_s": device_s,
        "host_s": host_s,
        "overhead_s": overhead_s,
        "total_s": overhead_s + max(device_s, host_s),
    }


def layer_time(
    m: int,
    q: int,
    hits: int,
    expert_bytes: float,
    hw: HardwareProfile,
    expert_flops: float = 0.0,
) -> float:
    """Seconds for one MoE layer with `hits` resident experts, m misses, q transferred."""
    return layer_components(m, q, hits, expert_bytes, hw, expert_flops)["total_s"]


@dataclasses.dataclass(frozen=True)
class QSweep:
    m: int
    points: list[tuple[int, float]]  # (q, layer seconds) for q = 0..m
    best_q: int  # argmin over q (ties: smaller q)
    q_star: int  # the runtime's rule, fetch_count(m, B_P / B_H)

    @property
    def best_s(self) -> float:
        return self.points[self.best_q][1]

    @property
    def q_star_s(self) -> float:
        return self.points[self.q_star][1]


def q_sweep(
    m: int,
    hw: HardwareProfile,
    expert_bytes: float = DEFAULT_EXPERT_BYTES,
    hits: int = 0,
    expert_flops: float = 0.0,
) -> QSweep:
    """Layer time for every split q = 0..m of m misses, its argmin, and q*."""
    points = [(q, layer_time(m, q, hits, expert_bytes, hw, expert_flops)) for q in range(m + 1)]
    best_q = min(range(m + 1), key=lambda q: (points[q][1], q))
    return QSweep(m=m, points=points, best_q=best_q, q_star=fetch_count(m, hw.ratio))


def non_expert_time(geometry: ModelGeometry, hw: HardwareProfile, context: int) -> float:
    """Seconds per token outside the routed experts at `context` tokens of context."""
    read = geometry.non_expert_bytes + context * geometry.kv_bytes_per_token
    return hw.per_token_overhead_s + read / (hw.device_mem_gbps * GB)


def replay(
    trace: Trace,
    policy: str,
    slots: int,
    hw: HardwareProfile,
    profile: Trace | None = None,
):
    """Replay `policy` with the machine's bandwidth split (static: host only)."""
    if policy in LRU_POLICIES:
        return simulate_lru(trace, slots, policy, hw.bandwidth)
    if POLICIES[policy].kind == "static":
        return run_policy(policy, trace, slots, profile=profile)
    return run_policy(policy, trace, slots, fetch_rule("lru", hw.bandwidth), profile)


def simulate_decode(
    trace: Trace,
    policy: str,
    slots: int,
    hw: HardwareProfile,
    geometry: ModelGeometry,
    *,
    context_tokens: int = 0,
    warmup_prefill: bool = False,
    warmup_tokens: int = 0,
    profile: Trace | None = None,
) -> dict:
    """Simulated batch-1 decode of the trace's decode tokens on machine `hw`.

    context_tokens: context length at the first decode token (grows by one per token).
    warmup_prefill: replay the trace's prefill records first (fill, not timed).
    warmup_tokens: replay the first decode tokens without timing or counting them
        (steady state instead of a cold cache on short traces).
    Returns tok_per_s, per_token_s, miss_rate and counts over the timed tokens,
    and a time breakdown.
    """
    if (trace.num_layers, trace.num_experts) != (geometry.num_moe_layers, geometry.num_experts):
        raise ValueError(
            f"trace has {trace.num_layers} MoE layers x {trace.num_experts} experts, "
            f"geometry {geometry.num_moe_layers} x {geometry.num_experts}"
        )
    replayed = trace if warmup_prefill else trace.decode_only()
    result = replay(replayed, policy, slots, hw, profile)
    decode = [s for s in result.steps if s.phase == "decode"]
    timed_steps = set(list(dict.fromkeys(s.step for s in decode))[warmup_tokens:])
    timed = [s for s in decode if s.step in timed_steps]

    token_s: dict[int, float] = {}
    parts = dict.fromkeys(("non_expert_s", "device_s", "host_s", "overhead_s", "expert_layers_s"), 0.0)
    for s in timed:
        if s.step not in token_s:
            token_s[s.step] = non_expert_time(geometry, hw, context_tokens + warmup_tokens + len(token_s))
            parts["non_expert_s"] += token_s[s.step]
        m, q = len(s.fetched) + len(s.host), len(s.fetched)
        c = layer_components(m, q, len(s.hits), geometry.expert_bytes, hw, geometry.expert_flops)
        token_s[s.step] += c["total_s"]
        parts["expert_layers_s"] += c["total_s"]
        for key in ("device_s", "host_s", "overhead_s"):
            parts[key] += c[key]

    per_token = list(token_s.values())
    total = float(np.sum(per_token)) if per_token else 0.0
    hits = sum(len(s.hits) for s in timed)
    fetched = sum(len(s.fetched) for s in timed)
    host = sum(len(s.host) for s in timed)
    selections = hits + fetched + host
    return {
        "policy": policy,
        "machine": hw.name,
        "slots": slots,
        "cache_fraction": slots / geometry.num_expert_slots_total,
        "num_tokens": len(per_token),
        "tok_per_s": len(per_token) / total if total > 0 else 0.0,
        "per_token_s": per_token,
        "miss_rate": (fetched + host) / selections if selections else 0.0,
        "selections": selections,
        "hits": hits,
        "misses": fetched + host,
        "fetched": fetched,
        "host_computed": host,
        "time_s": parts,
    }
