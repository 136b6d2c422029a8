"""Bandwidth profile: B_P (host->device expert transfer) and B_H (host expert kernel).

The decode policy splits the m experts missed in a layer with r = min(1, B_P / B_H):
q* is floor(m*r) or ceil(m*r), whichever gives the smaller max(q*(1-r), (m-q)*r) (the
slower of the two paths, in units of one expert's bytes / B_H), ties to the smaller q
(`ftjax.experts.policy.adaptive_q`); the q* transferred experts go to the device, the
other m - q* run on the host. Both numbers are measured here the way the runtime moves
and computes experts, never read off a spec sheet:

- B_P: what the decode step does with a fetched expert: `copy_expert` (the executor's
  in-step copy of one pool row into a cache slot) run in a loop inside ONE jitted
  program over many experts, timed as a whole (one dispatch and one sync per call of
  hundreds of MB) and divided by the bytes copied. The pool is `host.pool_view` (on the
  CPU backend an alias of host memory, so the copy is a memcpy; elsewhere pinned host
  memory, so it is the H2D DMA) and the cache spans at least the last-level cache.
- B_H: expert weight bytes per second through the C++ kernel at batch 1 with top-k
  distinct experts per call (how decode uses it).
- Working set: both rotate over a pool several times (4x) the last-level cache and at
  least 1 GiB (`working_set_bytes`, bounded by available memory), so weights come from
  DRAM, not from a large L3. The host read bandwidth over a buffer of the same size,
  measured in the same run, is the ceiling B_H cannot beat; the ratio B_H / ceiling is
  recorded beside every profile and a ratio above 1.1 prints a warning (the
  measurement was served from cache).
- Both alone, then both at once from two Python threads (the kernel releases the GIL),
  since decode overlaps them. GB/s = 1e9 bytes/s; warm-up first, medians.

Profiles are JSON, keyed by machine (hostname, CPU model, backend platform, device
kind), expert dtype, expert shape [D, F], host threads and top-k (B_H depends on
both), stored in $FTJAX_PROFILE_DIR/profiles.json or ~/.cache/ftjax/profiles.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
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

from ftjax.experts.executor import copy_expert
from ftjax.experts.pool import HostExpertPool, canonical_dtype, to_bf16_bits
from ftjax.experts.storage import BLOCK_FORMATS
from ftjax.runinfo import cpu_model, git_commit
from ftjax.host import HostExecutor, default_threads, isa_report, pool_view, read_bandwidth_gbps

PROFILE_VERSION = 2  # 2: working set sized from the LLC, B_P in one program, keyed by threads and top-k
DEFAULT_SHAPE = (2048, 768)  # [D, F] of Qwen3-30B-A3B experts
DEFAULT_TOP_K = 8
LLC_MULTIPLE = 4  # working set = LLC_MULTIPLE x the last-level cache ...
MIN_WORKING_SET = 1 << 30  # ... and at least 1 GiB ...
MEMORY_SHARE = 0.4  # ... and at most this share of the available memory
CACHE_RATIO_WARN = 1.1  # B_H above 1.1 x the host read ceiling: served from a cache


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


def profile_key(machine: str, dtype: str, d_model: int, d_ff: int, threads: int,
                top_k: int = DEFAULT_TOP_K) -> str:
    return f"{machine}|{canonical_dtype(dtype)}|{d_model}x{d_ff}|threads={threads}|top_k={top_k}"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"version": PROFILE_VERSION, "profiles": {}}
    if data.get("version") != PROFILE_VERSION or not isinstance(data.get("profiles"), dict):
        return {"version": PROFILE_VERSION, "profiles": {}}
    return data


def save_profile(result: dict, path: Path | None = None) -> Path:
    """Store a `measure` result under its (machine, dtype, shape, threads, top-k) key;
    atomic replace."""
    path = Path(path) if path else profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read(path)
    d_model, d_ff = result["expert_shape"]
    key = profile_key(result["machine_key"], result["dtype"], d_model, d_ff, int(result["threads"]),
                      int(result.get("top_k", DEFAULT_TOP_K)))
    data["profiles"][key] = result
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".profiles-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def load_profile(dtype, d_model: int, d_ff: int, path: Path | None = None,
                 machine: str | None = None, *, threads: int | None = None,
                 top_k: int = DEFAULT_TOP_K) -> tuple[float, float] | None:
    """(b_p_gbps, b_h_gbps) measured on this machine for this dtype, shape, host thread
    count (None: the cores this process may use, as `HostExecutor`) and top-k, or None."""
    data = _read(Path(path) if path else profile_path())
    key = profile_key(machine or machine_key(), dtype, d_model, d_ff, threads or default_threads(), top_k)
    entry = data["profiles"].get(key)
    if entry is None:
        return None
    return float(entry["b_p_gbps"]), float(entry["b_h_gbps"])


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def get_or_measure(dtype, d_model: int, d_ff: int, threads: int | None = None,
                   path: Path | None = None, *, top_k: int = DEFAULT_TOP_K,
                   working_set: int | None = None, seconds: float = 0.5,
                   log=_stderr) -> tuple[float, float]:
    """The stored profile, or measure (a few seconds), save and return it. Measuring
    says so first, on stderr (or through `log`), and prints one line when done."""
    threads = threads or default_threads()
    found = load_profile(dtype, d_model, d_ff, path, threads=threads, top_k=top_k)
    if found is not None:
        return found
    log(f"ftjax: measuring host bandwidth B_P / B_H for {canonical_dtype(dtype)} experts [{d_model}, {d_ff}], "
        f"{threads} threads, top-{top_k} (once for this machine; saved to {Path(path) if path else profile_path()}) ...")
    t0 = time.perf_counter()
    result = measure((d_model, d_ff), dtype, threads, top_k=top_k, pool_bytes=working_set, seconds=seconds, log=log)
    save_profile(result, path)
    log(f"ftjax: measured in {time.perf_counter() - t0:.1f} s: {summary_line(result)}")
    return result["b_p_gbps"], result["b_h_gbps"]


# ---------------------------------------------------------------------------- working set


def parse_cache_size(text: str) -> int | None:
    """A sysfs cache size ('32768K', '1M', '512') -> bytes, or None."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", text, re.IGNORECASE)
    if not m:
        return None
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def last_level_cache_bytes(sysfs: str | os.PathLike = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """Size of the highest-level data/unified CPU cache (the L3 on x86 servers): sysfs
    `index*/level` and `index*/size`, else `os.sysconf('SC_LEVEL3_CACHE_SIZE')` (then L2);
    None when nothing says."""
    best: tuple[int, int] | None = None  # (level, bytes)
    for index in sorted(Path(sysfs).glob("index*")):
        try:
            level = int((index / "level").read_text().strip())
            size = parse_cache_size((index / "size").read_text())
            kind = (index / "type").read_text().strip() if (index / "type").exists() else "Unified"
        except (OSError, ValueError):
            continue
        if size and kind != "Instruction" and (best is None or (level, size) > best):
            best = (level, size)
    if best is not None:
        return best[1]
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            value = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if value and value > 0:
            return int(value)
    return None


def available_memory_bytes(meminfo: str | os.PathLike = "/proc/meminfo") -> int | None:
    """MemAvailable from /proc/meminfo, else free pages from sysconf; None if unknown."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def working_set_bytes(llc_bytes: int | None, available_bytes: int | None, *,
                      multiple: int = LLC_MULTIPLE, minimum: int = MIN_WORKING_SET,
                      memory_share: float = MEMORY_SHARE) -> int:
    """Bytes the measurements rotate over: `multiple` x the last-level cache and at least
    `minimum` (an unknown LLC gives the minimum), but at most `memory_share` of the
    available memory (pool, cache slots and read buffer all need room; never below
    64 MiB)."""
    want = max(minimum, multiple * (llc_bytes or 0))
    if available_bytes:
        want = min(want, max(64 << 20, int(available_bytes * memory_share)))
    return int(want)


def default_working_set() -> int:
    return working_set_bytes(last_level_cache_bytes(), available_memory_bytes())


def cache_ratio_warning(result: dict) -> str | None:
    """The warning for B_H above CACHE_RATIO_WARN x the host read ceiling, else None."""
    ratio = result.get("b_h_over_read_ceiling")
    if ratio is None or ratio <= CACHE_RATIO_WARN:
        return None
    return (f"warning: B_H {result['b_h_gbps']:.1f} GB/s is {ratio:.2f}x the host read ceiling "
            f"{result['host_read_gbps']:.1f} GB/s over the same {result['working_set_bytes'] / 2**20:.0f} MiB "
            f"(above {CACHE_RATIO_WARN}): the weights came from a CPU cache, not memory; B_H is too high")


def summary_line(result: dict) -> str:
    llc = result.get("llc_bytes")
    return (f"B_P {result['b_p_gbps']:.2f} GB/s, B_H {result['b_h_gbps']:.2f} GB/s "
            f"(concurrent {result['b_p_concurrent_gbps']:.2f} / {result['b_h_concurrent_gbps']:.2f}), host read "
            f"ceiling {result['host_read_gbps']:.2f} GB/s, B_H / ceiling {result['b_h_over_read_ceiling']:.2f}; "
            f"{result['dtype']} [D, F] = {result['expert_shape']}, {result['threads']} threads, "
            f"top-{result['top_k']}, working set {result['working_set_bytes'] / 2**20:.0f} MiB "
            f"(LLC {f'{llc / 2**20:.0f} MiB' if llc else 'unknown'})"
            + (f"; kernels: {result['isa']['auto']}, AMX-BF16 {result['isa']['amx_bf16']}, "
               f"AMX-INT8 {result['isa'].get('amx_int8', '?')}" if "isa" in result else ""))


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


def _copy_many(cache, pool, start, count):
    """cache slots <- `count` pool experts of layer 0, starting at expert `start`,
    rotating over experts and slots: the executor's in-step `copy_expert`, in a loop."""
    num_experts = next(iter(pool.values())).shape[1]
    num_slots = next(iter(cache.values())).shape[0]

    def body(i, cache):
        return copy_expert(cache, pool, 0, (start + i) % num_experts, i % num_slots)

    return jax.lax.fori_loop(0, count, body, cache)


_copy_many_jit = jax.jit(_copy_many, donate_argnums=(0,))


class _Transfer:
    """One jitted program per call that copies `count` experts (hundreds of MB) from the
    pool into cache slots; timed as a whole, so dispatch and sync are amortised."""

    def __init__(self, pool: HostExpertPool, num_slots: int, call_bytes: int):
        self.pool, self.start = pool, 0
        self.view = pool_view(pool)
        # at most 2048 copies per call: tiny experts would otherwise make one call a loop of
        # ~10^5 iterations, timing the loop rather than the copies
        self.count = max(1, min(4 * pool.num_experts, call_bytes // pool.expert_bytes, 2048))
        slots = max(1, min(num_slots, pool.num_experts))
        # The cache pytree the executor's slots use: one [slots, ...] array per pool part.
        self.cache = {k: jnp.zeros((slots, *a.shape[2:]), a.dtype) for k, a in self.view.items()}

    def __call__(self) -> int:
        self.cache = _copy_many_jit(self.cache, self.view, np.int32(self.start), np.int32(self.count))
        jax.block_until_ready(self.cache)
        self.start = (self.start + self.count) % self.pool.num_experts
        return self.count * self.pool.expert_bytes


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


def _timed(op, iters: int) -> tuple[list[float], float]:
    """GB/s of each of `iters` calls, and the seconds they took together."""
    rates, total = [], 0.0
    for _ in range(iters):
        start = time.perf_counter()
        num_bytes = op()
        elapsed = time.perf_counter() - start
        rates.append(num_bytes / elapsed / 1e9)
        total += elapsed
    return rates, total


def balanced_iters(iters: tuple[int, int], seconds: tuple[float, float], at_least: int = 5) -> tuple[int, int]:
    """Call counts for two ops run side by side that keep them busy for the same wall
    time: each op's count scaled by (the longer op's seconds / its own), from its calls
    alone (`iters` calls took `seconds`). Per-call bytes and rates differ between the
    paths (a 2,048-expert copy against a top-k kernel call), so seconds, not rates, are
    what must match."""
    longest = max(seconds)
    return tuple(max(at_least, round(n * longest / max(t, 1e-9))) for n, t in zip(iters, seconds))


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
        results[k] = _timed(op, iters)[0]

    threads = [threading.Thread(target=run, args=(k, op, n)) for k, (op, n) in enumerate(ops_iters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def measure(expert_shape: tuple[int, int] = DEFAULT_SHAPE, dtype="bfloat16",
            threads: int | None = None, *, top_k: int = DEFAULT_TOP_K, pool_bytes: int | None = None,
            seconds: float = 0.5, warmup: int = 2, log=_stderr) -> dict:
    """Measure B_P and B_H (alone and concurrently) for experts of shape [D, F], and the
    host read ceiling, over a working set of `pool_bytes` (None: `default_working_set()`,
    4x the last-level cache and at least 1 GiB; tests pass a few MB)."""
    d_model, d_ff = expert_shape
    dtype, threads = canonical_dtype(dtype), threads or default_threads()
    llc = last_level_cache_bytes()
    working_set = int(pool_bytes) if pool_bytes else working_set_bytes(llc, available_memory_bytes())
    # The ceiling first, over a buffer of the same size (freed before the pool is filled).
    ceiling = read_bandwidth_gbps(threads, num_bytes=max(working_set, 1 << 20), repeats=3)
    pool = _filled_pool(d_model, d_ff, dtype, working_set, top_k)
    # Cache slots spanning at least the LLC (a quarter of the working set), so the copy's
    # writes go to memory as they do into a real device cache of hundreds of MB.
    num_slots = max(top_k, working_set // 4 // pool.expert_bytes)
    transfer = _Transfer(pool, num_slots, call_bytes=max(working_set // 4, 16 * pool.expert_bytes))
    compute = _HostCompute(pool, threads, top_k)
    n_p, n_h = _iters_for(transfer, seconds, warmup), _iters_for(compute, seconds, warmup)
    (b_p, seconds_p), (b_h, seconds_h) = _timed(transfer, n_p), _timed(compute, n_h)
    # Same wall time for both in the concurrent run, so they overlap throughout.
    n_p_c, n_h_c = balanced_iters((n_p, n_h), (seconds_p, seconds_h))
    start = time.perf_counter()
    b_p_c, b_h_c = _concurrent([(transfer, n_p_c), (compute, n_h_c)])
    concurrent_seconds = time.perf_counter() - start
    info = machine_info()
    b_h_median = statistics.median(b_h)
    result = {
        "b_p_gbps": statistics.median(b_p), "b_h_gbps": b_h_median,
        "b_p_concurrent_gbps": statistics.median(b_p_c),
        "b_h_concurrent_gbps": statistics.median(b_h_c),
        "host_read_gbps": ceiling,  # the ceiling B_H is measured against, same working set
        "b_h_over_read_ceiling": b_h_median / ceiling,
        "working_set_bytes": pool.total_bytes, "llc_bytes": llc, "cache_slots": num_slots,
        "transfer_experts_per_call": transfer.count,
        # wall seconds: each path alone, then both side by side (about the longer alone)
        "seconds": {"transfer": seconds_p, "compute": seconds_h, "concurrent": concurrent_seconds},
        "dtype": dtype, "expert_shape": [d_model, d_ff], "expert_bytes": pool.expert_bytes,
        "threads": threads, "top_k": top_k, "machine": info, "machine_key": machine_key(info),
        "isa": isa_report(),  # the kernels' paths here: AUTO's exact ISA, the AMX self-checks, the GEMV prefetch
        "commit": git_commit(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    warning = cache_ratio_warning(result)
    result["warnings"] = [warning] if warning else []
    if warning and log:
        log(warning)
    return result


# ---------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftjax profile",
                                description="Measure B_P (host->device) and B_H (host kernel) bandwidth.")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument("--threads", type=int, default=None, help="host kernel threads (default: every usable core)")
    p.add_argument("--dtype", choices=["bf16", "f32", *BLOCK_FORMATS], default="bf16",
                   help="expert weight format (default: bf16; a block format: the profile is in its bytes)")
    p.add_argument("--shape", type=int, nargs=2, metavar=("D", "F"), default=list(DEFAULT_SHAPE),
                   help=f"expert shape (default: {DEFAULT_SHAPE[0]} {DEFAULT_SHAPE[1]}, Qwen3-30B-A3B)")
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K,
                   help=f"experts per kernel call (default: {DEFAULT_TOP_K})")
    p.add_argument("--seconds", type=float, default=0.5, help="time per measurement (default: 0.5)")
    p.add_argument("--working-set-mib", type=float, default=None,
                   help=f"bytes to rotate over, MiB (default: {LLC_MULTIPLE}x the last-level cache, at least "
                        f"{MIN_WORKING_SET >> 20} MiB, at most {MEMORY_SHARE:.0%} of the available memory)")
    p.add_argument("--no-save", action="store_true", help="do not write the profile file")
    return p


def main_profile(argv: list[str] | None = None) -> int:
    """`ftjax profile [--json] [--threads N] [--dtype bf16|f32|q8_0|...|fp8_e4m3] [--shape D F]`."""
    args = _parser().parse_args(argv)
    pool_bytes = int(args.working_set_mib * 2**20) if args.working_set_mib else None
    result = measure(tuple(args.shape), args.dtype, args.threads, top_k=args.top_k, seconds=args.seconds,
                     pool_bytes=pool_bytes, log=None)
    if not args.no_save:
        result["profile_path"] = str(save_profile(result))
    for warning in result["warnings"]:  # also with --json: a profile served from cache must be noticed
        print(warning, file=sys.stderr)
    if not args.json:
        print(summary_line(result), file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0
