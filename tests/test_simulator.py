"""Tests for the decode-time model: hand-computed layer and token times, machines, geometry."""

import json

import pytest

from ftjax.lab import (
    PAPER_MACHINES,
    HardwareProfile,
    ModelGeometry,
    Trace,
    fetch_count,
    from_profile,
    layer_components,
    layer_time,
    q_sweep,
    qwen3_30b_a3b,
    simulate_decode,
    synthetic_trace,
)
from ftjax.lab.report import decode_table, plot_decode_bars, plot_q_sweep, write_policy_report

# S = 0.1 GB; B_P 10, B_H 40, device 100 GB/s: fill 10 ms / expert, host 2.5 ms alone,
# 3.33 ms next to a transfer (B_H - B_P = 30), device compute 1 ms
HW = HardwareProfile("hand", b_p_gbps=10.0, b_h_gbps=40.0, device_mem_gbps=100.0, per_layer_overhead_s=1e-4)
S = 1e8


def test_layer_time_by_hand():
    # m=4, q=1, 2 hits: device 10 + 3 x 1 = 13 ms; host 3 x 0.1 / 30 = 10 ms
    c = layer_components(4, 1, 2, S, HW)
    assert c["fill_s"] == pytest.approx(0.010)
    assert c["device_s"] == pytest.approx(0.013)
    assert c["host_s"] == pytest.approx(0.010)
    assert c["total_s"] == pytest.approx(0.0131)
    assert layer_time(4, 0, 2, S, HW) == pytest.approx(1e-4 + 0.010)  # host alone at 40 GB/s
    assert layer_time(4, 4, 2, S, HW) == pytest.approx(1e-4 + 0.040 + 0.006)  # transfer-only
    assert layer_time(0, 0, 3, S, HW) == pytest.approx(1e-4 + 0.003)  # all hits
    with pytest.raises(ValueError):
        layer_time(2, 3, 0, S, HW)


def test_layer_time_options():
    hw = HardwareProfile(
        "c", 10.0, 40.0, 100.0, device_tflops=1e-3, host_sync_s=0.002, b_h_concurrent_gbps=35.0
    )
    # compute bound on the device: 1e9 flops / 1e9 flop/s = 1 s per expert
    assert layer_components(0, 0, 1, S, hw, expert_flops=1e9)["device_s"] == pytest.approx(1.0)
    # measured concurrent bandwidth replaces B_H - B_P; a host layer pays the sync
    assert layer_components(3, 1, 0, S, hw)["host_s"] == pytest.approx(2 * 0.1 / 35 + 0.002)
    # B_H <= B_P: the CPU gets nothing while the transfer runs
    starved = HardwareProfile("s", 50.0, 40.0, 100.0)
    assert layer_time(3, 1, 0, S, starved) == float("inf")


def test_q_sweep_by_hand():
    sweep = q_sweep(4, HW, S, hits=2)
    assert [q for q, _ in sweep.points] == [0, 1, 2, 3, 4]
    assert sweep.points[1][1] == pytest.approx(0.0131)
    assert sweep.points[2][1] == pytest.approx(1e-4 + 0.020 + 0.004)  # fill 20 + 4 x 1 ms
    assert sweep.q_star == fetch_count(4, 0.25) == 1
    # the paper's contention model: T(q*) = m S / B_H = T(0); device compute tips it to 0
    assert sweep.best_q == 0 and sweep.best_s == pytest.approx(0.0101)
    free = HardwareProfile("free", 10.0, 40.0, 1e9, b_h_concurrent_gbps=40.0)
    assert q_sweep(5, free, S).best_q == 1  # no contention: 10 ms vs 4 x 2.5 ms


# 2 MoE layers x 4 experts, top-2; S = 3 D F x 2 bytes = 30 MB; non-expert 1 GB = 10 ms
GEOM = ModelGeometry(
    num_layers=2, num_moe_layers=2, num_experts=4, top_k=2, d_model=1000, d_ff=5000,
    bytes_per_weight=2, non_expert_bytes=1e9, kv_bytes_per_token=1e6,
)
HW2 = HardwareProfile("hand2", b_p_gbps=10.0, b_h_gbps=40.0, device_mem_gbps=100.0)


def two_token_trace():
    rows = [(0, [0, 1]), (1, [2, 3]), (0, [0, 1]), (1, [2, 3])]
    records = [
        {"step": i // 2, "layer": layer, "phase": "decode", "selected": sel}
        for i, (layer, sel) in enumerate(rows)
    ]
    return Trace.from_records(records, 2, 4)


def test_simulate_decode_by_hand():
    trace = two_token_trace()
    assert GEOM.expert_bytes == 3e7
    # token j reads j x 1 MB of KV at 100 GB/s: +0.01 ms for the second token
    # transfer-only, room for all: token 0 fills 2 x 2 experts (6 ms + 0.6 ms each layer)
    r = simulate_decode(trace, "lru-transfer-only", 8, HW2, GEOM)
    assert r["per_token_s"] == pytest.approx([0.010 + 2 * 0.0066, 0.01001 + 2 * 0.0006])
    assert r["tok_per_s"] == pytest.approx(2 / 0.03441)
    assert r["miss_rate"] == 0.5 and r["fetched"] == 4 and r["hits"] == 4
    # host-only: 2 x 30 MB / 40 GB/s = 1.5 ms a layer
    r = simulate_decode(trace, "lru-host-only", 8, HW2, GEOM)
    assert r["per_token_s"] == pytest.approx([0.013, 0.01301])
    # the bandwidth split at r = .25: m = 2 -> q = 0, the same as host-only
    assert simulate_decode(trace, "lru", 8, HW2, GEOM)["per_token_s"] == pytest.approx([0.013, 0.01301])
    # static-layer with 4 slots pins layer 0: 0.6 ms on device + 1.5 ms on host
    r = simulate_decode(trace, "static-layer", 4, HW2, GEOM)
    assert r["per_token_s"] == pytest.approx([0.0121, 0.01211]) and r["fetched"] == 0
    # context grows by one token per step: 1 MB x (100, 101) at 100 GB/s
    r = simulate_decode(trace, "lru-host-only", 8, HW2, GEOM, context_tokens=100)
    assert r["per_token_s"] == pytest.approx([0.014, 0.01401])
    # overheads are added per token and per MoE layer
    hw = HardwareProfile("o", 10.0, 40.0, 100.0, per_layer_overhead_s=1e-3, per_token_overhead_s=2e-3)
    r = simulate_decode(trace, "lru-host-only", 8, hw, GEOM)
    assert r["per_token_s"] == pytest.approx([0.017, 0.01701])
    assert sum(r["time_s"][k] for k in ("non_expert_s", "expert_layers_s")) == pytest.approx(0.03401)


def test_simulate_decode_other_policies_and_checks():
    trace = synthetic_trace(2, 4, 2, 20, 0.5, seed=0)
    for policy in ("reuse-rate", "belady", "lfu", "lru-per-layer", "static-frequency"):
        r = simulate_decode(trace, policy, 4, HW2, GEOM)
        assert r["num_tokens"] == 20 and r["tok_per_s"] > 0 and len(r["per_token_s"]) == 20
    with pytest.raises(ValueError):
        simulate_decode(synthetic_trace(3, 4, 2, 5, 0.5), "lru", 4, HW2, GEOM)


def test_paper_machines():
    bw = {name: hw.bandwidth for name, hw in PAPER_MACHINES.items()}
    assert bw == {
        "rtx5090-server": (52.7, 77.3),
        "rtx4090": (25.1, 63.2),
        "rtx5090-desktop": (49.0, 53.8),
        "rtx4060-laptop": (11.8, 47.5),
        "rtx-pro-6000": (51.5, 178.0),
    }
    assert fetch_count(4, PAPER_MACHINES["rtx4060-laptop"].ratio) == 1  # the paper's example
    assert all(hw.device_mem_gbps > hw.b_h_gbps and hw.device_mem_gib for hw in PAPER_MACHINES.values())


def test_from_profile(tmp_path):
    hw = from_profile({"B_P": 9.5, "b_h": 14.0, "device_mem_gbps": 21.0, "machine": "dev", "junk": 1})
    assert (hw.name, hw.b_p_gbps, hw.b_h_gbps, hw.device_mem_gbps) == ("dev", 9.5, 14.0, 21.0)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"b_p_gbps": 9.5, "b_h_gbps": 14.0, "device_mem_gbps": 21.0}))
    hw = from_profile(path, name="cpu", per_layer_overhead_s=5e-5)
    assert hw.name == "cpu" and hw.per_layer_overhead_s == 5e-5
    with pytest.raises(ValueError):
        from_profile({"b_p_gbps": 1.0})


def test_geometry():
    g = qwen3_30b_a3b()
    assert (g.num_moe_layers, g.num_experts, g.top_k) == (48, 128, 8)
    assert g.expert_bytes == 3 * 2048 * 768 * 2
    assert g.kv_bytes_per_token == 48 * 2 * 4 * 128 * 2
    # attention 48 x 2048 x 128 x (64 + 8), router 48 x 2048 x 128, LM head + embedding row
    weights = 48 * 2048 * 128 * 72 + 48 * 2048 * 128 + 151936 * 2048 + 2048
    assert g.non_expert_bytes == weights * 2
    assert g.slots_that_fit(32.0, reserved_gib=4.0) == int((28 * 2**30 - weights * 2) // g.expert_bytes)
    assert g.slots_that_fit(1.0) == 0


def test_report_plots_and_tables(tmp_path):
    sweeps = {name: q_sweep(8, hw) for name, hw in PAPER_MACHINES.items()}
    plot_q_sweep(sweeps, tmp_path / "q_sweep.png")
    pairs = [("a", "lru"), ("a", "x"), ("b", "lru")]
    rows = [{"machine": m, "policy": p, "tok_per_s": 10.0 + i} for i, (m, p) in enumerate(pairs)]
    plot_decode_bars(rows, tmp_path / "bars.png")
    for name in ("q_sweep.png", "bars.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert decode_table(rows).splitlines()[2] == "| a | 10.0 | 11.0 |"


def test_write_policy_report(tmp_path):
    trace = synthetic_trace(2, 4, 2, 30, 0.5, seed=1)
    out = write_policy_report(trace, tmp_path, fractions=(0.25, 0.5), geometry=GEOM, machines={"hand": HW2})
    for name in ("cache_policies.json", "miss_rate.png", "q_sweep.png", "decode_tok_s.png", "report.md"):
        assert (tmp_path / name).exists()
    assert len(out["decode"]) == 5 and "| machine |" in (tmp_path / "report.md").read_text()


def test_simulate_decode_warmup_tokens():
    trace = two_token_trace()
    # token 0 fills the cache untimed; token 1 (context 1) is all hits
    r = simulate_decode(trace, "lru-transfer-only", 8, HW2, GEOM, warmup_tokens=1)
    assert r["num_tokens"] == 1 and r["miss_rate"] == 0.0 and r["hits"] == 4
    assert r["per_token_s"] == pytest.approx([0.01001 + 2 * 0.0006])
