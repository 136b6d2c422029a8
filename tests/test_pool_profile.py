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


def fake_result(machine_key, dtype="bfloat16", shape=(64, 32), b_p=1.5, b_h=3.0, threads=2, top_k=8):
    return {"b_p_gbps": b_p, "b_h_gbps": b_h, "dtype": dtype, "expert_shape": list(shape),
            "machine_key": machine_key, "threads": threads, "top_k": top_k}


def test_profile_json_round_trip_and_keying(tmp_path, monkeypatch):
    monkeypatch.setenv("FTJAX_PROFILE_DIR", str(tmp_path))
    here = profile.machine_key()
    assert profile.load_profile("bf16", 64, 32, threads=2) is None
    path = profile.save_profile(fake_result(here))
    assert path == tmp_path / "profiles.json"
    profile.save_profile(fake_result(here, "float32", b_p=5.0, b_h=6.0))
    profile.save_profile(fake_result("elsewhere|cpu|gpu|H200", b_p=9.0, b_h=9.0))
    assert profile.load_profile("bfloat16", 64, 32, threads=2) == (1.5, 3.0)
    assert profile.load_profile("f32", 64, 32, threads=2) == (5.0, 6.0)
    assert profile.load_profile("bf16", 32, 64, threads=2) is None  # shape is part of the key
    assert profile.load_profile("bf16", 64, 32, machine="elsewhere|cpu|gpu|H200", threads=2) == (9.0, 9.0)
    profile.save_profile(fake_result(here, b_p=2.5))  # re-measuring replaces
    assert profile.load_profile("bf16", 64, 32, threads=2) == (2.5, 3.0)
    assert len(json.loads(path.read_text())["profiles"]) == 3
    assert profile.get_or_measure("bf16", 64, 32, threads=2) == (2.5, 3.0)  # stored: no measuring


def test_profiles_are_keyed_by_threads_and_top_k(tmp_path, monkeypatch):
    """`ftjax profile --threads 1` must not overwrite what `load(threads=2)` uses."""
    monkeypatch.setenv("FTJAX_PROFILE_DIR", str(tmp_path))
    here = profile.machine_key()
    profile.save_profile(fake_result(here, threads=2, b_h=3.0))
    profile.save_profile(fake_result(here, threads=1, b_h=1.7))
    profile.save_profile(fake_result(here, threads=2, top_k=4, b_h=2.2))
    assert profile.load_profile("bf16", 64, 32, threads=2) == (1.5, 3.0)
    assert profile.load_profile("bf16", 64, 32, threads=1) == (1.5, 1.7)
    assert profile.load_profile("bf16", 64, 32, threads=2, top_k=4) == (1.5, 2.2)
    assert profile.load_profile("bf16", 64, 32, threads=3) is None
    monkeypatch.setattr(profile, "default_threads", lambda: 1)  # threads=None: the cores we may use
    assert profile.load_profile("bf16", 64, 32) == (1.5, 1.7)
    assert profile.get_or_measure("bf16", 64, 32, threads=None) == (1.5, 1.7)


def test_old_profile_versions_are_not_used(tmp_path):
    path = tmp_path / "profiles.json"
    old = {"version": 1, "profiles": {f"{profile.machine_key()}|bfloat16|64x32": fake_result(profile.machine_key())}}
    path.write_text(json.dumps(old))
    assert profile.load_profile("bf16", 64, 32, path=path, threads=2) is None


def test_first_measuring_load_says_so(tmp_path, capsys):
    path = tmp_path / "profiles.json"
    got = profile.get_or_measure("bf16", 40, 24, threads=2, path=path, top_k=2, working_set=1 << 20,
                                 seconds=0.02)
    err = capsys.readouterr().err
    assert "measuring host bandwidth" in err and "[40, 24]" in err and "2 threads" in err and str(path) in err
    assert "measured in" in err and "B_H / ceiling" in err
    assert profile.load_profile("bf16", 40, 24, path=path, threads=2, top_k=2) == got
    assert profile.get_or_measure("bf16", 40, 24, threads=2, path=path, top_k=2) == got  # stored now
    assert capsys.readouterr().err == ""  # and silent


def test_corrupt_profile_file_is_ignored(tmp_path):
    path = tmp_path / "profiles.json"
    path.write_text("{not json")
    assert profile.load_profile("bf16", 8, 8, path=path, threads=2) is None
    profile.save_profile(fake_result(profile.machine_key(), shape=(8, 8)), path)
    assert profile.load_profile("bf16", 8, 8, path=path, threads=2) == (1.5, 3.0)


def test_working_set_size_from_the_last_level_cache():
    GiB, MiB = 1 << 30, 1 << 20
    assert profile.working_set_bytes(32 * MiB, 64 * GiB) == GiB  # small L3: the 1 GiB minimum
    assert profile.working_set_bytes(480 * MiB, 64 * GiB) == 4 * 480 * MiB  # big L3: 4x it
    assert profile.working_set_bytes(None, 64 * GiB) == GiB  # unknown LLC: the minimum
    assert profile.working_set_bytes(480 * MiB, 2 * GiB) == int(0.4 * 2 * GiB)  # bounded by free memory
    assert profile.working_set_bytes(480 * MiB, None) == 4 * 480 * MiB  # unknown free memory: unbounded
    assert profile.working_set_bytes(480 * MiB, 10 * MiB) == 64 * MiB  # never below 64 MiB
    assert profile.working_set_bytes(8 * MiB, None, multiple=8, minimum=0) == 64 * MiB


def fake_sysfs(root, caches):
    for i, (level, kind, size) in enumerate(caches):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return root


def test_last_level_cache_from_sysfs(tmp_path, monkeypatch):
    sysfs = fake_sysfs(tmp_path / "a", [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                        (3, "Unified", "491520K")])
    assert profile.last_level_cache_bytes(sysfs) == 480 << 20
    sysfs = fake_sysfs(tmp_path / "b", [(1, "Data", "48K"), (2, "Unified", "2M")])  # no L3: the L2
    assert profile.last_level_cache_bytes(sysfs) == 2 << 20
    assert profile.parse_cache_size("32768K") == 32 << 20 and profile.parse_cache_size("junk") is None
    monkeypatch.setattr(profile.os, "sysconf", lambda name: 12 << 20 if name == "SC_LEVEL3_CACHE_SIZE" else 0)
    assert profile.last_level_cache_bytes(tmp_path / "none") == 12 << 20  # no sysfs: sysconf

    def unknown(name):
        raise ValueError(name)

    monkeypatch.setattr(profile.os, "sysconf", unknown)
    assert profile.last_level_cache_bytes(tmp_path / "none") is None


def test_cache_ratio_warning():
    r = {"b_h_gbps": 40.0, "host_read_gbps": 24.0, "b_h_over_read_ceiling": 40 / 24, "working_set_bytes": 128 << 20}
    assert "1.67x the host read ceiling" in profile.cache_ratio_warning(r)
    assert profile.cache_ratio_warning({**r, "b_h_gbps": 20.0, "b_h_over_read_ceiling": 20 / 24}) is None
    assert profile.cache_ratio_warning({**r, "b_h_over_read_ceiling": 1.1}) is None  # the threshold itself passes


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_measure_tiny_shape(dtype):
    result = profile.measure((40, 24), dtype, threads=2, top_k=2, pool_bytes=1 << 20, seconds=0.02)
    for key in ("b_p_gbps", "b_h_gbps", "b_p_concurrent_gbps", "b_h_concurrent_gbps", "host_read_gbps",
                "b_h_over_read_ceiling"):
        assert result[key] > 0, key
    assert result["b_h_over_read_ceiling"] == pytest.approx(result["b_h_gbps"] / result["host_read_gbps"])
    assert result["working_set_bytes"] >= 1 << 20 and result["transfer_experts_per_call"] >= 1
    assert isinstance(result["warnings"], list)
    assert result["expert_shape"] == [40, 24] and result["threads"] == 2 and result["top_k"] == 2
    assert result["dtype"] == canonical_dtype(dtype)
    assert result["machine_key"] == profile.machine_key()
    # side by side, the two paths run about as long as the longer one alone (tiny experts'
    # copies and kernel calls move very different bytes a call: balanced by seconds)
    seconds = result["seconds"]
    assert seconds["concurrent"] < 4 * max(seconds["transfer"], seconds["compute"]) + 0.5


def test_balanced_iters_match_wall_time_not_rates():
    # 5 copies took 0.5 s, 250 kernel calls took 0.5 s: already balanced
    assert profile.balanced_iters((5, 250), (0.5, 0.5)) == (5, 250)
    # the kernel calls took a quarter of the time: four times as many of them
    assert profile.balanced_iters((10, 100), (1.0, 0.25)) == (10, 400)
    assert profile.balanced_iters((10, 100), (0.1, 1.0)) == (100, 100)
    assert profile.balanced_iters((1, 1), (1.0, 1.0)) == (5, 5)  # at least 5 calls each


def test_transfer_copies_pool_rows_into_slots():
    """B_P times the executor's in-step copy: after a call the slots hold the pool rows."""
    pool = HostExpertPool.allocate(1, 5, 8, 4, "f32")
    for e in range(5):
        pool.gate_up[0, e] = e + 1
        pool.down[0, e] = -(e + 1)
    pool.freeze()
    op = profile._Transfer(pool, num_slots=3, call_bytes=4 * pool.expert_bytes)
    assert op.count == 4 and op() == 4 * pool.expert_bytes
    gu = np.asarray(op.cache["gate_up"])
    assert [gu[s, 0, 0] for s in range(3)] == [4.0, 2.0, 3.0]  # experts 0..3 into slots 0,1,2,0
    assert np.asarray(op.cache["down"])[1, 0, 0] == -2.0
    op()  # experts 4, 0, 1, 2 -> slots 0, 1, 2, 0
    assert [np.asarray(op.cache["gate_up"])[s, 0, 0] for s in range(3)] == [3.0, 1.0, 2.0]


def test_main_profile_prints_json_and_saves(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FTJAX_PROFILE_DIR", str(tmp_path))
    assert profile.main_profile(["--json", "--shape", "32", "16", "--threads", "1", "--seconds", "0.02",
                                 "--top-k", "2", "--working-set-mib", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(line)
    for key in ("b_p_gbps", "b_h_gbps", "dtype", "expert_shape", "threads", "machine", "commit",
                "host_read_gbps", "b_h_over_read_ceiling", "working_set_bytes", "llc_bytes"):
        assert key in result
    assert profile.load_profile("bf16", 32, 16, threads=1, top_k=2) == (result["b_p_gbps"], result["b_h_gbps"])
    assert profile.load_profile("bf16", 32, 16, threads=2, top_k=2) is None  # --threads 1 is its own entry
