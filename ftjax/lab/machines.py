"""Hardware profiles for the decode-time model: the paper's five machines and ours.

A `HardwareProfile` holds the handful of numbers the cost model needs (all
bandwidths in GB/s = 1e9 bytes/s):

  b_p_gbps          host -> device transfer bandwidth of expert weights (B_P)
  b_h_gbps          host expert-kernel bandwidth: expert bytes the CPU consumes per s (B_H)
  device_mem_gbps   device memory bandwidth (expert and non-expert compute is memory bound)
  device_tflops     device dense bf16 tensor throughput (roofline cap; rarely binding)
  device_mem_gib, host_mem_gib   capacities (cache sizing)
  per_layer_overhead_s   fixed cost per MoE layer (launch / bookkeeping)
  per_token_overhead_s   fixed cost per token (sampling, dispatch)
  host_sync_s       extra cost of a layer that uses the host path (callback / sync)
  b_p_concurrent_gbps, b_h_concurrent_gbps   bandwidths measured while both paths
                    run at once; None = the paper's model (B_P unchanged, the CPU keeps
                    B_H - B_P because the DMA reads the same DRAM)

B_P and B_H of the five machines are the paper's measurements (its Table 2). The
device figures are public spec-sheet values (vendor product pages, rounded) and
only matter for hits and non-expert weights; host RAM is known only where the
paper states it. `from_profile` builds a profile from this machine's measured
numbers (the runtime's profiler output), so simulated and measured tok/s can be
compared.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    name: str
    b_p_gbps: float
    b_h_gbps: float
    device_mem_gbps: float
    device_tflops: float = float("inf")
    device_mem_gib: float | None = None
    host_mem_gib: float | None = None
    per_layer_overhead_s: float = 0.0
    per_token_overhead_s: float = 0.0
    host_sync_s: float = 0.0
    b_p_concurrent_gbps: float | None = None
    b_h_concurrent_gbps: float | None = None

    @property
    def bandwidth(self) -> tuple[float, float]:
        """(B_P, B_H) as simulate_lru takes it."""
        return (self.b_p_gbps, self.b_h_gbps)

    @property
    def ratio(self) -> float:
        """r = min(1, B_P / B_H): the fraction of misses worth transferring."""
        return min(1.0, self.b_p_gbps / self.b_h_gbps)


# Public spec values (vendor pages, rounded): memory bandwidth, VRAM, dense BF16
# tensor TFLOPS with FP32 accumulate. RTX 5090: 1792 GB/s, 32 GB, ~209;
# RTX 4090: 1008 GB/s, 24 GB, ~165; RTX 4060 Laptop: 256 GB/s (128-bit, 16 Gbps),
# 8 GB, ~30 (TGP dependent); RTX PRO 6000 Blackwell: 1792 GB/s, 96 GB, ~500.
PAPER_MACHINES: dict[str, HardwareProfile] = {
    m.name: m
    for m in [
        HardwareProfile("rtx5090-server", 52.7, 77.3, 1792.0, 209.0, 32.0),
        HardwareProfile("rtx4090", 25.1, 63.2, 1008.0, 165.0, 24.0),
        HardwareProfile("rtx5090-desktop", 49.0, 53.8, 1792.0, 209.0, 32.0),
        HardwareProfile("rtx4060-laptop", 11.8, 47.5, 256.0, 30.0, 8.0),
        HardwareProfile("rtx-pro-6000", 51.5, 178.0, 1792.0, 500.0, 96.0, 512.0),
    ]
}

_ALIASES = {
    "b_p": "b_p_gbps",
    "B_P": "b_p_gbps",
    "transfer_gbps": "b_p_gbps",
    "b_h": "b_h_gbps",
    "B_H": "b_h_gbps",
    "host_expert_gbps": "b_h_gbps",
    "device_gbps": "device_mem_gbps",
    "machine": "name",
}


def from_profile(
    profile: Mapping[str, Any] | str | Path, *, name: str | None = None, **overrides: Any
) -> HardwareProfile:
    """A HardwareProfile from measured numbers: a mapping or a JSON file path.

    Keys are HardwareProfile field names (a few aliases: b_p / B_P, b_h / B_H,
    machine); unknown keys are ignored; `overrides` win. b_p_gbps, b_h_gbps and
    device_mem_gbps are required (on a CPU-only box the "device" is the CPU: use
    its measured read bandwidth).
    """
    if isinstance(profile, (str, Path)):
        profile = json.loads(Path(profile).read_text())
    fields = {f.name for f in dataclasses.fields(HardwareProfile)}
    values = {}
    for key, value in {**profile, **overrides}.items():
        key = _ALIASES.get(key, key)
        if key in fields:
            values[key] = value
    if name is not None:
        values["name"] = name
    values.setdefault("name", "measured")
    missing = {"b_p_gbps", "b_h_gbps", "device_mem_gbps"} - values.keys()
    if missing:
        raise ValueError(f"profile lacks {sorted(missing)} (pass them as keyword overrides)")
    return HardwareProfile(**values)
