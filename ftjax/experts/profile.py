"""Bandwidth profile: B_P (host->device expert transfer) and B_H (host expert kernel).

The decode policy splits the m experts missed in a layer: q* = round(m * B_P / B_H)
go to the device, the rest run on the host. Both numbers are measured here the way
the runtime moves and computes experts, never read off a spec sheet:

- B_P: `jax.device_put` of one expert's pool slices, then a jitted, donated
  `dynamic_update_slice` into a preallocated device cache slot, then
  `block_until_ready`. On the CPU backend device_put of an aligned array is an
  alias, so the slot update is the real copy; on an accelerator it is the H2D DMA.
- B_H: expert weight bytes per second through the C++ kernel at batch 1 with
  top-k distinct experts per call (how decode uses it), rotating over a pool much
  larger than the last-level cache so weights come from DRAM.
- Both alone, then both at once from two Python threads (the kernel releases the
  GIL), since decode overlaps them. GB/s = 1e9 bytes/s; warm-up first, medians.
  The host read bandwidth (the ceiling for B_H) is recorded beside them.

Profiles are JSON, keyed by machine (hostname, CPU model, backend platform, device
kind), expert dtype and expert shape [D, F], stored in $FTJAX_PROFILE_DIR/profiles.json
or ~/.cache/ftjax/profiles.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.experts.pool import HostExpertPool, canonical_dtype, to_bf16_bits
from ftjax.runinfo import cpu_model, git_commit
from ftjax.host import HostExecutor, default_threads, read_bandwidth_gbps

PROFILE_VERSION = 1
DEFAULT_SHAPE = (2048, 768)  # [D, F] of Qwen3-30B-A3B experts


# ---------------------------------------------------------------------------- machine


def machine_info() -> dict:
    device = jax.devices()[0]
    return {"hostname": socket.gethostname(), "cpu": cpu_model(),
            "platform": device.platform, "device_kind": device.device_kind}


def machine_key(info: dict | None = None) -> str:
    info = info or machine_info()
    return "|".join((info["hostname"], info["cpu"], info["platform"], info["device_kind"]))


# ---------------------------------------------------------------------------- storage


def profile_path() -> Path:
    root = os.environ.get("FTJAX_PROFILE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "ftjax"
    return base / "profiles.json"


def profile_key(machine: str, dtype: str, d_model: int, d_ff: int) -> str:
    return f"{machine}|{canonical_dtype(dtype)}|{d_model}x{d_ff}"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"version": PROFILE_VERSION, "profiles": {}}
    if data.get("version") != PROFILE_VERSION or not isinstance(data.get("profiles"), dict):
        return {"version": PROFILE_VERSION, "profiles": {}}
    return data


def save_profile(result: dict, path: Path | None = None) -> Path:
    """Store a `measure` result under its (machine, dtype, shape) key; atomic replace."""
    path = Path(path) if path else profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read(path)
    d_model, d_ff = result["expert_shape"]
    data["profiles"][profile_key(result["machine_key"], result["dtype"], d_model, d_ff)] = result
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".profiles-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def load_profile(dtype, d_model: int, d_ff: int, path: Path | None = None,
                 machine: str | None = None) -> tuple[float, float] | None:
    """(b_p_gbps, b_h_gbps) measured on this machine for this dtype and shape, or None."""
    data = _read(Path(path) if path else profile_path())
    entry = data["profiles"].get(profile_key(machine or machine_key(), dtype, d_model, d_ff))
    if entry is None:
        return None
    return float(entry["b_p_gbps"]), float(entry["b_h_gbps"])


def get_or_measure(dtype, d_model: int, d_ff: int, threads: int | None = None,
                   path: Path | None = None) -> tuple[float, float]:
    """The stored profile, or measure (a few seconds), save and return it."""
    found = load_profile(dtype, d_model, d_ff, path)
    if found is not None:
        return found
    result = measure((d_model, d_ff), dtype, threads)
    save_profile(result, path)
    return result["b_p_gbps"], result["b_h_gbps"]


# ---------------------------------------------------------------------------- measure


def _filled_pool(d_model: int, d_ff: int, dtype: str, pool_bytes: int, top_k: int) -> HostExpertPool:
    probe = HostExpertPool.allocate(1, 1, d_model, d_ff, dtype)
    num_experts = max(2 * top_k, math.ceil(pool_bytes / probe.expert_bytes))
    pool = HostExpertPool.allocate(1, num_experts, d_model, d_ff, dtype)
    value = np.float32(0.01)  # every page written: no shared zero page on reads
    fill = to_bf16_bits(np.array(value))[()] if pool.dtype == "bfloat16" else value
    pool.gate_up.fill(fill)
    pool.down.fill(fill)
    return pool.freeze()


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _fill_slot(cache_gu, cache_dn, slot, gate_up, down):
    """cache_gu [S, 2F, D], cache_dn [S, D, F] <- one expert into slot (in place)."""
    cache_gu = jax.lax.dynamic_update_slice(cache_gu, gate_up[None], (slot, 0, 0))
    cache_dn = jax.lax.dynamic_update_slice(cache_dn, down[None], (slot, 0, 0))
    return cache_gu, cache_dn


class _Transfer:
    """One host->device expert copy per call, cycling over pool experts and slots."""

    def __init__(self, pool: HostExpertPool, num_slots: int):
        self.pool, self.num_slots, self.i = pool, num_slots, 0
        gu, dn = pool.expert(0, 0)
        self.cache = (jnp.zeros((num_slots,) + gu.shape, gu.dtype),
                      jnp.zeros((num_slots,) + dn.shape, dn.dtype))

    def __call__(self) -> int:
        gu, dn = self.pool.expert(0, self.i % self.pool.num_experts)
        slot = np.int32(self.i % self.num_slots)
        self.cache = _fill_slot(*self.cache, slot, jax.device_put(gu), jax.device_put(dn))
        jax.block_until_ready(self.cache)
        self.i += 1
        return self.pool.expert_bytes


class _HostCompute:
    """One batch-1 kernel call over top_k distinct experts, rotating over the pool."""

    def __init__(self, pool: HostExpertPool, threads: int, top_k: int):
        self.pool, self.top_k, self.i = pool, top_k, 0
        self.executor = HostExecutor(pool, threads=threads)
        self.x = np.full((1, pool.d_model), 0.01, np.float32)  # [T=1, D]
        self.weights = np.full((1, top_k), 1.0 / top_k, np.float32)  # [T, K]
        self.y = np.empty_like(self.x)

    def __call__(self) -> int:
        ids = (self.i * self.top_k + np.arange(self.top_k)) % self.pool.num_experts
        self.executor.expert_ffn_numpy(self.x, 0, ids[None].astype(np.int32), self.weights, out=self.y)
        self.i += 1
        return self.top_k * self.pool.expert_bytes


def _timed(op, iters: int) -> list[float]:
    """GB/s of each of `iters` calls."""
    rates = []
    for _ in range(iters):
        start = time.perf_counter()
        num_bytes = op()
        rates.append(num_bytes / (time.perf_counter() - start) / 1e9)
    return rates


def _iters_for(op, seconds: float, warmup: int) -> int:
    """Warm up, then the number of calls that fill about `seconds` (at least 5)."""
    for _ in range(warmup):
        op()
    start = time.perf_counter()
    op()
    return max(5, min(500, int(seconds / max(time.perf_counter() - start, 1e-6))))


def _concurrent(ops_iters: list[tuple]) -> list[list[float]]:
    """Run each (op, iters) in its own thread, started together."""
    barrier = threading.Barrier(len(ops_iters))
    results: list[list[float]] = [[] for _ in ops_iters]

    def run(k, op, iters):
        barrier.wait()
        results[k] = _timed(op, iters)

    threads = [threading.Thread(target=run, args=(k, op, n)) for k, (op, n) in enumerate(ops_iters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def measure(expert_shape: tuple[int, int] = DEFAULT_SHAPE, dtype="bfloat16",
            threads: int | None = None, *, top_k: int = 8, pool_bytes: int = 128 << 20,
            seconds: float = 0.5, warmup: int = 2) -> dict:
    """Measure B_P and B_H (alone and concurrently) for experts of shape [D, F]."""
    d_model, d_ff = expert_shape
    dtype, threads = canonical_dtype(dtype), threads or default_threads()
    pool = _filled_pool(d_model, d_ff, dtype, pool_bytes, top_k)
    transfer, compute = _Transfer(pool, num_slots=top_k), _HostCompute(pool, threads, top_k)
    n_p, n_h = _iters_for(transfer, seconds, warmup), _iters_for(compute, seconds, warmup)
    b_p, b_h = _timed(transfer, n_p), _timed(compute, n_h)
    # Same wall time for both in the concurrent run, so they overlap throughout.
    t_p, t_h = n_p / statistics.median(b_p), n_h / statistics.median(b_h)
    scale = max(t_p, t_h) / min(t_p, t_h)
    n_p_c, n_h_c = (n_p, int(n_h * scale)) if t_p > t_h else (int(n_p * scale), n_h)
    b_p_c, b_h_c = _concurrent([(transfer, max(5, n_p_c)), (compute, max(5, n_h_c))])
    ceiling = read_bandwidth_gbps(threads, num_bytes=max(pool_bytes, 1 << 20), repeats=3)
    info = machine_info()
    return {
        "b_p_gbps": statistics.median(b_p), "b_h_gbps": statistics.median(b_h),
        "b_p_concurrent_gbps": statistics.median(b_p_c),
        "b_h_concurrent_gbps": statistics.median(b_h_c),
        "host_read_gbps": ceiling,  # the ceiling B_H is measured against
        "dtype": dtype, "expert_shape": [d_model, d_ff], "expert_bytes": pool.expert_bytes,
        "threads": threads, "top_k": top_k, "machine": info, "machine_key": machine_key(info),
        "commit": git_commit(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# ---------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftjax profile",
                                description="Measure B_P (host->device) and B_H (host kernel) bandwidth.")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument("--threads", type=int, default=None, help="host kernel threads (default: cores)")
    p.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    p.add_argument("--shape", type=int, nargs=2, metavar=("D", "F"), default=list(DEFAULT_SHAPE))
    p.add_argument("--top-k", type=int, default=8, help="experts per kernel call")
    p.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    p.add_argument("--no-save", action="store_true", help="do not write the profile file")
    return p


def main_profile(argv: list[str] | None = None) -> int:
    """`ftjax profile [--json] [--threads N] [--dtype bf16|f32] [--shape D F]`."""
    args = _parser().parse_args(argv)
    result = measure(tuple(args.shape), args.dtype, args.threads, top_k=args.top_k,
                     seconds=args.seconds)
    if not args.no_save:
        result["profile_path"] = str(save_profile(result))
    if not args.json:
        print(f"B_P {result['b_p_gbps']:.2f} GB/s, B_H {result['b_h_gbps']:.2f} GB/s "
              f"(concurrent {result['b_p_concurrent_gbps']:.2f} / {result['b_h_concurrent_gbps']:.2f}) "
              f"{result['dtype']} [D, F] = {result['expert_shape']}, {result['threads']} threads",
              file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0
