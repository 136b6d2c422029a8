"""Offline expert-cache lab and decode-time simulator (pure numpy).

    routing trace --> cache engine (slots, hits/misses, q split, eviction) --> per-record outcomes
       (trace)          (cache: run_cache; lru: the runtime's rules;           |
                         policies: scores, static pins, miss-rate curves)      v
                                               decode-time model (simulator + machines + geometry)
                                                                               |
                                                                 report: JSON, PNG, markdown

Modules: trace (Trace, .npz), synthetic (traces with tunable locality), cache (the
engine), lru (simulate_lru: the reference the jitted runtime is tested against),
policies (registry, miss_rate_curve), machines (HardwareProfile, the paper's five),
geometry (ModelGeometry), simulator (layer_time, q_sweep, simulate_decode), report.
"""

from ftjax.lab.cache import CacheResult, CacheStep, run_cache
from ftjax.lab.geometry import ModelGeometry, qwen3_30b_a3b
from ftjax.lab.lru import (
    LruResult,
    fetch_count,
    fetch_count_table,
    fetch_rule,
    first_mismatch,
    simulate_lru,
)
from ftjax.lab.machines import PAPER_MACHINES, HardwareProfile, from_profile
from ftjax.lab.policies import OUR_POLICY, POLICIES, miss_rate_curve, run_policy, slots_for
from ftjax.lab.simulator import QSweep, layer_components, layer_time, q_sweep, simulate_decode
from ftjax.lab.synthetic import synthetic_trace
from ftjax.lab.trace import Trace

__all__ = [
    "CacheResult",
    "CacheStep",
    "HardwareProfile",
    "LruResult",
    "ModelGeometry",
    "OUR_POLICY",
    "PAPER_MACHINES",
    "POLICIES",
    "QSweep",
    "Trace",
    "fetch_count",
    "fetch_count_table",
    "fetch_rule",
    "first_mismatch",
    "from_profile",
    "layer_components",
    "layer_time",
    "miss_rate_curve",
    "q_sweep",
    "qwen3_30b_a3b",
    "run_cache",
    "run_policy",
    "simulate_decode",
    "simulate_lru",
    "slots_for",
    "synthetic_trace",
]
