"""Host expert pool (alignment, read-only, bf16 bits) and the bandwidth profile
(measure on a tiny shape, JSON round trip, keying by machine / dtype / shape)."""

import json

import ml_dtypes
import numpy as np
import pytest

from ftjax.experts import profile
from ftjax.experts.pool import (HostExpertPool, aligned_empty, bf16_bits_to_f32, canonical_dtype,
                                is_aligned, to_bf16_bits)


@pytest.mark.parametrize("shape,dtype", [((3, 5), np.float32), ((7,), np.uint16), ((2, 3, 37), np.float32)])
def test_aligned_empty(shape, dtype):
    for _ in range(5):
        a = aligned_empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.ctypes.data % 64 == 0 and a.flags.c_contiguous


def test_allocate_freeze_read_only_and_sizes():
    pool = HostExpertPool.allocate(2, 3, 16, 8, "bf16")
    pool.gate_up[...] = 1
    pool.down[...] = 2
    assert not pool.frozen
    pool.freeze()
    assert pool.frozen and is_aligned(pool.gate_up) and is_aligned(pool.down)
    with pytest.raises(ValueError):
        pool.gate_up[0, 0, 0, 0] = 3
    assert (pool.num_layers, pool.num_experts, pool.d_model, pool.d_ff) == (2, 3, 16, 8)
    assert pool.dtype == "bfloat16" and pool.gate_up.dtype == np.uint16
    assert pool.expert_bytes == (2 * 8 * 16 + 16 * 8) * 2
    assert pool.layer_bytes == 3 * pool.expert_bytes and pool.total_bytes == 2 * pool.layer_bytes
    gate_up, down = pool.expert(1, 2)
    assert gate_up.shape == (16, 16) and down.shape == (16, 8) and np.shares_memory(gate_up, pool.gate_up)


def test_from_arrays_accepts_f32_bits_and_ml_dtypes():
    rng = np.random.default_rng(0)
    gate_up = rng.standard_normal((1, 2, 6, 5)).astype(np.float32)
    down = rng.standard_normal((1, 2, 5, 3)).astype(np.float32)
    f32 = HostExpertPool.from_arrays(gate_up[..., :], down)
    assert f32.dtype == "float32" and f32.frozen and np.array_equal(f32.gate_up, gate_up)
    bits = HostExpertPool.from_arrays(to_bf16_bits(gate_up), to_bf16_bits(down))
    ml = HostExpertPool.from_arrays(gate_up.astype(ml_dtypes.bfloat16), down.astype(ml_dtypes.bfloat16))
    assert bits.dtype == ml.dtype == "bfloat16"
    assert np.array_equal(bits.gate_up, ml.gate_up) and np.array_equal(bits.down, ml.down)
    unaligned = np.empty(gate_up.size + 1, np.float32)[1:].reshape(gate_up.shape)
    unaligned[...] = gate_up
    assert is_aligned(HostExpertPool.from_arrays(unaligned, down).gate_up)
    with pytest.raises(ValueError):
        HostExpertPool.from_arrays(gate_up, down[..., :2])
    with pytest.raises(TypeError):
        HostExpertPool.from_arrays(gate_up.astype(np.float64), down)


def test_bf16_round_trip_matches_ml_dtypes():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 100,
                        np.array([0.0, -0.0, 1.0, 1.00390625, 1.01171875, np.inf, -np.inf, 3e38, 1e-40],
                                 np.float32)])
    bits = to_bf16_bits(x)
    assert np.array_equal(bits, x.astype(ml_dtypes.bfloat16).view(np.uint16))  # nearest-even
    back = bf16_bits_to_f32(bits)
    assert np.array_equal(to_bf16_bits(back), bits)  # exact both ways
    normal = np.isfinite(x) & (np.abs(x) > 1e-37)
    assert np.all(np.abs(back[normal] - x[normal]) <= np.abs(x[normal]) * 2.0 ** -8)
    assert np.isnan(bf16_bits_to_f32(to_bf16_bits(np.array([np.nan], np.float32)))).all()
    assert to_bf16_bits(np.float32(1.0)).shape == ()


def test_canonical_dtype():
    assert canonical_dtype("bf16") == canonical_dtype(np.uint16) == canonical_dtype(ml_dtypes.bfloat16) == "bfloat16"
    assert canonical_dtype("f32") == canonical_dtype(np.float32) == "float32"
    with pytest.raises(ValueError):
        canonical_dtype("int8")


def fake_result(machine_key, dtype="bfloat16", shape=(64, 32), b_p=1.5, b_h=3.0):
    return {"b_p_gbps": b_p, "b_h_gbps": b_h, "dtype": dtype, "expert_shape": list(shape),
            "machine_key": machine_key, "threads": 2}


def test_profile_json_round_trip_and_keying(tmp_path, monkeypatch):
    monkeypatch.setenv("FTJAX_PROFILE_DIR", str(tmp_path))
    here = profile.machine_key()
    assert profile.load_profile("bf16", 64, 32) is None
    path = profile.save_profile(fake_result(here))
    assert path == tmp_path / "profiles.json"
    profile.save_profile(fake_result(here, "float32", b_p=5.0, b_h=6.0))
    profile.save_profile(fake_result("elsewhere|cpu|gpu|H200", b_p=9.0, b_h=9.0))
    assert profile.load_profile("bfloat16", 64, 32) == (1.5, 3.0)
    assert profile.load_profile("f32", 64, 32) == (5.0, 6.0)
    assert profile.load_profile("bf16", 32, 64) is None  # shape is part of the key
    assert profile.load_profile("bf16", 64, 32, machine="elsewhere|cpu|gpu|H200") == (9.0, 9.0)
    profile.save_profile(fake_result(here, b_p=2.5))  # re-measuring replaces
    assert profile.load_profile("bf16", 64, 32) == (2.5, 3.0)
    assert len(json.loads(path.read_text())["profiles"]) == 3
    assert profile.get_or_measure("bf16", 64, 32) == (2.5, 3.0)  # stored: no measuring


def test_corrupt_profile_file_is_ignored(tmp_path):
    path = tmp_path / "profiles.json"
    path.write_text("{not json")
    assert profile.load_profile("bf16", 8, 8, path=path) is None
    profile.save_profile(fake_result(profile.machine_key(), shape=(8, 8)), path)
    assert profile.load_profile("bf16", 8, 8, path=path) == (1.5, 3.0)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_measure_tiny_shape(dtype):
    result = profile.measure((40, 24), dtype, threads=2, top_k=2, pool_bytes=1 << 20, seconds=0.02)
    for key in ("b_p_gbps", "b_h_gbps", "b_p_concurrent_gbps", "b_h_concurrent_gbps", "host_read_gbps"):
        assert result[key] > 0, key
    assert result["expert_shape"] == [40, 24] and result["threads"] == 2
    assert result["dtype"] == canonical_dtype(dtype)
    assert result["machine_key"] == profile.machine_key()


def test_main_profile_prints_json_and_saves(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FTJAX_PROFILE_DIR", str(tmp_path))
    assert profile.main_profile(["--json", "--shape", "32", "16", "--threads", "1", "--seconds", "0.02",
                                 "--top-k", "2"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(line)
    for key in ("b_p_gbps", "b_h_gbps", "dtype", "expert_shape", "threads", "machine", "commit"):
        assert key in result
    assert profile.load_profile("bf16", 32, 16) == (result["b_p_gbps"], result["b_h_gbps"])
