"""The bandwidth split q: predicted layer time for q = 0..m, and measured on this machine.

For m missed experts of one MoE layer, q go to the device and m - q run on the host:

    device path (main thread):  q x the runtime's fetch (`executor.copy_expert`: a row of
                                the pool in pinned_host memory moved into a donated device
                                cache slot) -> one jitted call computing the q experts
    host path (worker thread):  HostExecutor.expert_ffn_numpy over the other m - q experts
    layer time = wall time until both are done (block_until_ready), median over repeats

Every q uses the same two calls (an empty host call or a zero-expert device call when a
path has nothing to do), so the fixed costs of the harness are the same for every q.
Each run also times its two paths apart (device path: until its result is ready; host
path: inside the worker), both while the other runs, as the decode loop would see them:
layer time against max(device, host) and their sum is the overlap of the two halves.
Those timings feed the runtime's own online calibration (`experts.calibration`), starting
from the profile, and the q it settles on (`calibrated_q`) is checked against the best
measured split: our goal is a layer time within 10% of the best.
Experts rotate over a pool far larger than the last-level cache, so weights come from
DRAM as they would in decode. Predictions come from `lab.simulator.q_sweep` with this
machine's measured profile (B_P, B_H, both also measured concurrently) and the paper's
five machines; q* is the runtime's rule `fetch_count(m, B_P / B_H)`.
"""

from __future__ import annotations

import math
import queue
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.experts.calibration import Calibration
from ftjax.experts.executor import copy_expert, swiglu
from ftjax.experts.policy import get_policy
from ftjax.experts.pool import HostExpertPool, to_bf16_bits
from ftjax.experts.storage import empty_cache
from ftjax.host import HostExecutor, pool_view, sharding
from ftjax.lab.lru import fetch_count
from ftjax.lab.machines import HardwareProfile
from ftjax.lab.simulator import q_sweep


_fill = jax.jit(copy_expert, donate_argnums=0)  # the runtime's own fetch: slot <- pinned pool row, to device


@jax.jit
def _device_experts(cache, x, n):
    """Sum of the first n cached experts applied to x [1, D] (n traced: one compile)."""
    def body(s, y):
        return y + swiglu(cache["gate_up"][s], cache["down"][s], x)
    return jax.lax.fori_loop(0, n, body, jnp.zeros_like(x))


class _HostWorker:
    """A persistent thread running host-kernel calls handed to it (the kernel drops the GIL)."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while (job := self.jobs.get()) is not None:
            job()
            self.done.put(None)

    def submit(self, job):
        self.jobs.put(job)

    def wait(self):
        self.done.get()

    def close(self):
        self.jobs.put(None)
        self.thread.join()


class LayerWorkload:
    """m distinct experts of shape [D, F] split q / m - q between the two paths."""

    def __init__(self, d_model: int, d_ff: int, dtype: str, m: int, threads: int | None,
                 pool_bytes: int = 256 << 20):
        probe = HostExpertPool.allocate(1, 1, d_model, d_ff, dtype)
        num_experts = max(4 * m, math.ceil(pool_bytes / probe.expert_bytes))
        pool = HostExpertPool.allocate(1, num_experts, d_model, d_ff, dtype)
        value = np.float32(0.01)  # every page written: reads come from DRAM, not the zero page
        fill = to_bf16_bits(np.array(value))[()] if pool.dtype == "bfloat16" else value
        pool.gate_up.fill(fill)
        pool.down.fill(fill)
        self.pool = pool.freeze()
        self.m, self.expert_bytes = m, pool.expert_bytes
        self.host = HostExecutor(self.pool, threads=threads)
        self.pinned = pool_view(self.pool, "pinned_host")  # as the runtime places its pool
        self.cache = jax.device_put(empty_cache(self.pool.parts, m), sharding("device"))
        self.x_np = np.full((1, d_model), 0.01, np.float32)  # [T=1, D]
        self.x = jnp.asarray(self.x_np)
        self.y_host = np.empty_like(self.x_np)
        self.worker = _HostWorker()
        self.turn = 0
        self.paths: list[tuple[int, float, float]] = []  # per run: (q, device path s, host path s)

    def run(self, q: int) -> float:
        """Seconds for one layer with q experts transferred and m - q on the host."""
        m, E = self.m, self.pool.num_experts
        ids = (self.turn * m + np.arange(m)) % E
        self.turn += 1
        host_ids = ids[q:].astype(np.int32)[None]  # [T=1, m-q]
        weights = np.full(host_ids.shape, 1.0 / m, np.float32)

        host_s = [0.0]

        def host_job():
            if host_ids.size:
                t = time.perf_counter()
                self.host.expert_ffn_numpy(self.x_np, 0, host_ids, weights, out=self.y_host)
                host_s[0] = time.perf_counter() - t

        start = time.perf_counter()
        self.worker.submit(host_job)
        for slot, e in enumerate(ids[:q]):
            self.cache = _fill(self.cache, self.pinned, np.int32(0), np.int32(e), np.int32(slot))
        y = _device_experts(self.cache, self.x, np.int32(q))
        jax.block_until_ready(y)
        device_s = time.perf_counter() - start
        self.worker.wait()
        layer_s = time.perf_counter() - start
        self.paths.append((q, device_s, host_s[0]))
        return layer_s

    def sweep(self, repeats: int, warmup: int = 2, seed: int = 0) -> list[float]:
        """Median seconds for q = 0..m; q order shuffled each round so drift hits all q alike."""
        rng = np.random.default_rng(seed)
        for _ in range(warmup):
            for q in range(self.m + 1):
                self.run(q)
        self.paths.clear()  # the warm-up runs include compiling
        samples: list[list[float]] = [[] for _ in range(self.m + 1)]
        for _ in range(repeats):
            for q in rng.permutation(self.m + 1):
                samples[q].append(self.run(int(q)))
        return [statistics.median(s) for s in samples]

    def path_medians(self) -> tuple[list[float], list[float]]:
        """Median seconds of the device path and of the host path for q = 0..m, over the
        runs since the warm-up (each timed while the other path ran)."""
        device = [statistics.median([d for q, d, _ in self.paths if q == i] or [0.0]) for i in range(self.m + 1)]
        hosts = [statistics.median([h for q, _, h in self.paths if q == i] or [0.0]) for i in range(self.m + 1)]
        return device, hosts

    def close(self):
        self.worker.close()


def calibrated_q(paths: list[tuple[int, float, float]], m: int, expert_bytes: int,
                 profile: tuple[float, float]) -> dict:
    """The q the runtime's online calibration settles on for m misses: a `Calibration`
    (lru's q rule) starting from `profile` (B_P, B_H GB/s), fed each run's two path
    timings in order — q experts' bytes over the device path's time (copy + compute: the
    rate that path sustains while the host runs), m - q experts' over the host's."""
    cal = Calibration(profile, expert_bytes, get_policy("lru"), num_experts=m)
    for q, device_s, host_s in paths:
        if q:
            cal.observe_transfer(q * expert_bytes, device_s)
        if q < m:
            cal.observe_host((m - q) * expert_bytes, host_s)
    b_p, b_h = cal.bandwidth
    return {"q": fetch_count(m, cal.ratio), "b_p_gbps": b_p, "b_h_gbps": b_h,
            "samples": cal.stats()["samples"]}


def predicted(m: int, machines: dict[str, HardwareProfile], expert_bytes: float, expert_flops: float) -> dict:
    out = {}
    for name, hw in machines.items():
        s = q_sweep(m, hw, expert_bytes, expert_flops=expert_flops)
        out[name] = {"layer_s": [t for _, t in s.points], "best_q": s.best_q, "q_star": s.q_star,
                     "ratio": hw.ratio, "b_p_gbps": hw.b_p_gbps, "b_h_gbps": hw.b_h_gbps}
    return out


def measure_shape(name: str, d_model: int, d_ff: int, dtype: str, misses: list[int], hw_this: HardwareProfile,
                  paper: dict[str, HardwareProfile], threads: int | None, repeats: int, log=lambda m: None) -> dict:
    """Predicted (this machine + paper machines) and measured sweeps for each m in `misses`."""
    expert_flops = 2 * 3 * d_model * d_ff
    sweeps = []
    for m in misses:
        work = LayerWorkload(d_model, d_ff, dtype, m, threads)
        try:
            measured = work.sweep(repeats)
            device_s, host_s = work.path_medians()
        finally:
            work.close()
        best = min(range(m + 1), key=lambda q: (measured[q], q))
        q_star = fetch_count(m, hw_this.ratio)
        live = calibrated_q(work.paths, m, work.expert_bytes, (hw_this.b_p_gbps, hw_this.b_h_gbps))
        live.update(t_s=measured[live["q"]], slowdown=measured[live["q"]] / measured[best])
        pred = predicted(m, {"this-machine": hw_this, **paper}, work.expert_bytes, expert_flops)
        sweeps.append({"m": m, "q_star": q_star, "measured_s": measured, "measured_best_q": best,
                       "measured_q_star_s": measured[q_star], "measured_best_s": measured[best],
                       "q_star_slowdown": measured[q_star] / measured[best],
                       "transfer_only_s": measured[m], "host_only_s": measured[0], "calibrated": live,
                       "device_path_s": device_s, "host_path_s": host_s,
                       "predicted": pred})
        log(f"q sweep {name} m={m}: measured best q={best}, q*={q_star}, calibrated q={live['q']} "
            f"({measured[q_star] * 1e3:.3f} / {live['t_s'] * 1e3:.3f} vs {measured[best] * 1e3:.3f} ms)")
        expert_bytes = work.expert_bytes
    return {"name": name, "expert_shape": [d_model, d_ff], "dtype": dtype, "expert_bytes": expert_bytes,
            "this_machine": {"b_p_gbps": hw_this.b_p_gbps, "b_h_gbps": hw_this.b_h_gbps,
                             "b_p_concurrent_gbps": hw_this.b_p_concurrent_gbps,
                             "b_h_concurrent_gbps": hw_this.b_h_concurrent_gbps, "ratio": hw_this.ratio},
            "sweeps": sweeps}


def plot(shapes: list[dict], path) -> None:
    """One panel per (shape, m): measured and predicted ms for this machine, q* and argmins;
    a last panel: the paper machines' predicted layer time relative to q = 0."""
    from ftjax.bench.plots import pyplot

    plt = pyplot()
    panels = [(s, sw) for s in shapes for sw in s["sweeps"]]
    cols = len(panels) + 1
    fig, axes = plt.subplots(1, cols, figsize=(3.6 * cols, 3.6), squeeze=False)
    for ax, (shape, sw) in zip(axes[0], panels):
        qs = list(range(sw["m"] + 1))
        ax.plot(qs, [t * 1e3 for t in sw["measured_s"]], "k-o", ms=4, label="measured")
        pred = sw["predicted"]["this-machine"]["layer_s"]
        ax.plot(qs, [t * 1e3 for t in pred], "C0--.", label="predicted (profile)")
        ax.axvline(sw["q_star"], color="C3", ls=":", label=f"q* = {sw['q_star']}")
        ax.plot([sw["measured_best_q"]], [sw["measured_best_s"] * 1e3], "kx", ms=10, label="measured best")
        ax.set(title=f"{shape['name']} {shape['expert_shape']}, m={sw['m']}", xlabel="q transferred",
               ylabel="layer time (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    ref = panels[-1][1]
    for name, p in ref["predicted"].items():
        t0 = p["layer_s"][0]
        ax.plot(range(ref["m"] + 1), [t / t0 for t in p["layer_s"]], marker=".", label=f"{name} (q*={p['q_star']})")
    ax.set(title=f"predicted, {panels[-1][0]['name']} m={ref['m']}", xlabel="q transferred",
           ylabel="layer time / time at q=0")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
