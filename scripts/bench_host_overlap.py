"""Does a step cost max(host, device) with the start / finish pair, and host + device
without it? One JSON line.

A synthetic MoE layer whose two halves take a known time each, in one jitted step:
  host half    the routed-expert host kernel on --tokens tokens, --experts distinct
               experts of a bf16 pool (D x F), --host-threads workers
  device half  a chain of --device-matmuls [M, M] matmuls (XLA), M = --device-dim
Timed as jitted programs (medians of --repeats): host alone (start + finish), device
alone, `serial` (the blocking host call after the device half, data-dependent on it:
a step that costs host + device), `blocking` (the blocking call with no dependency
either way: what the executor does with overlap_host=False; XLA's CPU runtime may run
the two at once by itself) and `pair` (start, device half, finish, ordered by data:
what `load(overlap_host=True)` does). Ratios to max(host, device): pair_over_max (the
goal: <= 1.15), blocking_over_max and serial_over_max (~ (host + device) / max). And
`corun`: both halves at once with no step around them (the host kernel natively on a
Python thread, the device program on another): corun_over_max is what sharing this
machine costs by itself, pair_over_corun how close the pair comes to it. --pin-cores puts
XLA's threads (this one, which runs thunks inline, and its Eigen workers) on one core and
every other thread on the rest: without it XLA's Eigen workers spin on both cores and
take the host kernel's.

On the CPU backend the device half is XLA on this machine's cores: XLA_FLAGS (set here
unless given) keep XLA's dots to one thread (`--xla_cpu_multi_thread_eigen=false`, and
no XNNPACK / YNN fusions, which bring their own thread pools), so that XLA keeps to one
core and the host kernel's --host-threads to the others, as a GPU and the CPU would be. --device-matmuls 0 picks the count that makes the device half
about as long as the host half (the hardest case for overlap).

    OPENBLAS_NUM_THREADS=1 python scripts/bench_host_overlap.py [--tokens 32] [--experts 8] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false --xla_cpu_use_xnnpack=false "
                                    "--xla_cpu_experimental_ynn_fusion_type=")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ftjax.experts.pool import HostExpertPool, to_bf16_bits  # noqa: E402
from ftjax.host import HostExecutor  # noqa: E402
from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields  # noqa: E402,E501


def median_s(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pin_cores() -> dict:
    """The device half's threads (this one, which runs XLA's thunks inline, and XLA's
    Eigen workers) on the first core this process may use, every other thread (the host
    kernel's workers and the start / finish runner) on the rest: the split a GPU and the
    CPU would have. Call after the host executor's threads exist. -> the split."""
    cores = sorted(os.sched_getaffinity(0))
    device_cores, host_cores = set(cores[:1]), set(cores[1:]) or set(cores)
    main, placed = threading.get_native_id(), {"device": 0, "host": 0}
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        tid = int(task.name)
        name = (task / "comm").read_text().strip()
        device = tid == main or name.startswith("tf_XLA")
        os.sched_setaffinity(tid, device_cores if device else host_cores)
        placed["device" if device else "host"] += 1
    return {"device_cores": sorted(device_cores), "host_cores": sorted(host_cores), "threads": placed}


def corun_s(ex: HostExecutor, device, host_args, m, repeats: int, host_cores: list[int] | None = None) -> float:
    """Median wall time of the two halves run at once outside any step: the host kernel
    called natively on a Python thread (no JAX), the device program on this one. This
    is what the machine allows when both halves share it (cores, memory bandwidth,
    caches): the bound the pair is held to, next to max(host, device)."""
    import threading

    jax.block_until_ready(device(m))
    times = []
    for _ in range(repeats):
        t = threading.Thread(target=_on_cores, args=(host_cores, ex.expert_ffn_numpy, *host_args))
        t0 = time.perf_counter()
        t.start()
        jax.block_until_ready(device(m))
        t.join()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _on_cores(cores: list[int] | None, fn, *args):
    if cores:
        os.sched_setaffinity(0, set(cores))  # this thread only
    return fn(*args)


def programs(ex: HostExecutor, matmuls: int):
    def device(a):
        for _ in range(matmuls):
            a = jnp.tanh(a @ a)
        return a

    @jax.jit
    def host_alone(x, ids, w):
        return ex.expert_ffn_finish(ex.expert_ffn_start(x, jnp.int32(0), ids, w), x, x.shape)

    @jax.jit
    def blocking(x, ids, w, a):
        a = device(a)
        return ex.expert_ffn(x, jnp.int32(0), ids, w) + a[0, 0], a

    @jax.jit
    def serial(x, ids, w, a):
        a = device(a)
        x = x + jnp.minimum(a[0, 0], 0.0) * 0.0 + jnp.maximum(a[0, 0], 0.0) * 0.0  # after the device half
        return ex.expert_ffn(x, jnp.int32(0), ids, w) + a[0, 0], a

    @jax.jit
    def pair(x, ids, w, a):
        token = ex.expert_ffn_start(x, jnp.int32(0), ids, w)
        a = device(ex.after_start(token, a))
        return ex.expert_ffn_finish(token, a, x.shape) + a[0, 0], a

    return host_alone, jax.jit(device), blocking, pair, serial


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--experts", type=int, default=8, help="distinct experts the host half computes")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--host-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--device-dim", type=int, default=384)
    ap.add_argument("--device-matmuls", type=int, default=0, help="0: as many as make device ~ host")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--pin-cores", action="store_true",
                    help="XLA's threads on one core, the host kernel's on the others (sched_setaffinity)")
    add_allow_dirty_argument(ap)
    a = ap.parse_args(argv)
    check_clean_or_exit(a.allow_dirty)
    rng = np.random.default_rng(0)
    E, D, F = a.experts, a.d_model, a.d_ff
    gate_up = to_bf16_bits((rng.standard_normal((1, E, 2 * F, D)) / np.sqrt(D)).astype(np.float32))
    down = to_bf16_bits((rng.standard_normal((1, E, D, F)) / np.sqrt(F)).astype(np.float32))
    ex = HostExecutor(HostExpertPool.from_arrays(gate_up, down), threads=a.host_threads)
    x = rng.standard_normal((a.tokens, D)).astype(np.float32)
    ids = (np.arange(a.tokens * 2).reshape(a.tokens, 2) % E).astype(np.int32)  # every expert, top-2
    w = np.full((a.tokens, 2), 0.5, np.float32)
    m = jnp.asarray(rng.standard_normal((a.device_dim, a.device_dim)) / np.sqrt(a.device_dim), jnp.float32)

    host_alone, pinned = programs(ex, 0)[0], None
    if a.pin_cores:  # the host executor's threads exist once its first call ran
        jax.block_until_ready(host_alone(x, ids, w))
        pinned = pin_cores()
    host_s = median_s(host_alone, (x, ids, w), a.repeats)
    matmuls = a.device_matmuls
    if matmuls == 0:  # one matmul's time, then as many as the host half takes
        one = median_s(programs(ex, 1)[1], (m,), a.repeats)
        matmuls = max(1, round(host_s / one))
    _, device, blocking, pair, serial = programs(ex, matmuls)
    device_s = median_s(device, (m,), a.repeats)
    serial_s = median_s(serial, (x, ids, w, m), a.repeats)
    blocking_s = median_s(blocking, (x, ids, w, m), a.repeats)
    pair_s = median_s(pair, (x, ids, w, m), a.repeats)
    both_s = corun_s(ex, device, (x, 0, ids, w), m, a.repeats, pinned and pinned["host_cores"])
    y_pair, y_block = pair(x, ids, w, m)[0], blocking(x, ids, w, m)[0]
    longest = max(host_s, device_s)
    line = {"bench": "host_overlap", "tokens": a.tokens, "experts": E, "d_model": D, "d_ff": F,
            "host_threads": a.host_threads, "device_dim": a.device_dim, "device_matmuls": matmuls,
            "repeats": a.repeats, "xla_flags": os.environ.get("XLA_FLAGS", ""), "pinned": pinned,
            "host_ms": round(host_s * 1e3, 3), "device_ms": round(device_s * 1e3, 3),
            "serial_ms": round(serial_s * 1e3, 3), "blocking_ms": round(blocking_s * 1e3, 3),
            "pair_ms": round(pair_s * 1e3, 3), "pair_over_max": round(pair_s / longest, 3),
            "blocking_over_max": round(blocking_s / longest, 3), "serial_over_max": round(serial_s / longest, 3),
            "sum_over_max": round((host_s + device_s) / longest, 3),
            "corun_ms": round(both_s * 1e3, 3), "corun_over_max": round(both_s / longest, 3),
            "pair_over_corun": round(pair_s / both_s, 3),
            "same_result": bool(np.array_equal(np.asarray(y_pair), np.asarray(y_block))),
            **commit_info(), **machine_info(), **run_fields()}
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
