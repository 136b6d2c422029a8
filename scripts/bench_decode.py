"""Decode benchmarks of the expert executor: tok/s per policy and where a step's time goes.

Two modes, one JSON line per configuration on stdout (commit, machine, settings, numbers):

    --tiny         a small random qwen3_moe (8 layers, D 64, 16 experts, top-2), built with
                   transformers as tests/hf_models.py does. Per policy: median decode step
                   time and tok/s. Per-MoE-layer overhead = (step of the MoE model - step of
                   the same model with layers 1..7 dense via `mlp_only_layers`, dense FFN
                   size = K * F so the FLOPs match) / 7 (an all-dense model does not load:
                   the empty expert pool fails its alignment check). Fixed per-step cost =
                   step of a 1-layer MoE model - one dense layer - one MoE overhead.
    --model DIR    a real-geometry checkpoint (scripts/make_geometry_checkpoint.py). Per
                   policy: prompt --prompt ids, --new greedy tokens, decode tok/s. Then a
                   breakdown: the decode step with the routed experts removed (an executor
                   returning zeros), and jitted micro-benchmarks of the parts with the
                   model's shapes (LM head matvec f32 / bf16 / uint16-bits, attention
                   projections, device-path experts, host-kernel experts, sampling,
                   dispatch), each with bytes read and GB/s against the read ceiling.

Threads: `--threads N` pins this process to the first N cores (before jax starts, so
XLA's pool sees N cores) and gives the host expert kernel N threads.

Timing: a full warm-up generation first (compiles), then per-token wall time between
consecutive tokens of the real generation loop (`Model.generate_stream`, which reads
each token id back); medians. `cpu_ms_per_token` = process CPU time (all threads) per
token over the same loop: on a shared machine it excludes time spent waiting for a core,
so it is the fairer cross-framework number at 1 thread. Micro-benchmarks: warm-up, block_until_ready, median.

    OPENBLAS_NUM_THREADS=1 nice -n 5 python scripts/bench_decode.py --tiny
    OPENBLAS_NUM_THREADS=1 nice -n 5 python scripts/bench_decode.py --model /tmp/ftjax-geom --threads 1
"""

from __future__ import annotations

import argparse
import os
import sys


def _pin(threads: int | None) -> None:
    if threads and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:threads]))


if __name__ == "__main__":  # pin before jax creates its thread pools
    if "--threads" in sys.argv:
        _pin(int(sys.argv[sys.argv.index("--threads") + 1]))

import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields  # noqa: E402,E501

import ftjax  # noqa: E402
import ftjax.checkpoint  # noqa: E402
import ftjax.host  # noqa: E402
import ftjax.model  # noqa: E402
from ftjax.engine.steps import Steps  # noqa: E402
from ftjax.experts.executor import Executor, device_ffn  # noqa: E402
from ftjax.experts.storage import as_f32  # noqa: E402
from ftjax.experts.policy import get_policy  # noqa: E402
from ftjax.models.common import init_state  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------ reporting

def commit() -> dict:
    return commit_info()


def machine() -> dict:
    return {**machine_info(),
            "jax": jax.__version__}


def emit(kind: str, **fields) -> None:
    print(json.dumps({"bench": kind, **commit(), "machine": machine(), **fields, **run_fields()}), flush=True)


def rss_gib() -> float:
    kb = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
    return round(kb / 2**20, 2)


def peak_rss_gib() -> float:
    import resource
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def med_ms(xs) -> float:
    return round(statistics.median(xs) * 1e3, 4)


def timed(fn, *args, iters: int = 20, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t0)
    return out


# ------------------------------------------------------------------------------ decode timing

def step_times(model, prompt: list[int], new: int) -> tuple[list[float], list[int]]:
    """Per-token wall times of the real generation loop (after a full warm-up run)."""
    list(model.generate_stream(prompt, new))  # compile + warm
    model.reset_stats()
    stamps, toks = [], []
    for tok in model.generate_stream(prompt, new):
        stamps.append(time.perf_counter())
        toks.append(tok)
    return list(np.diff(stamps)), toks


class NoExperts(Executor):
    """The routed experts removed: y = 0 (router and everything else kept)."""

    def __call__(self, layer, x, ids, weights, valid, state, pool):
        return jnp.zeros_like(x), state


def step_times_without_experts(model, new: int, pos0: int) -> list[float]:
    """The model's decode step with a zero executor, same loop shape as generate_stream."""
    cfg = model.config
    ex = NoExperts(get_policy("device"), num_layers=cfg.num_moe_layers, num_experts=cfg.num_experts, slots=0,
                   transfer_ratio=1.0, host_fn=None)
    steps = Steps(model._graphdef, ex)
    params = steps.param_leaves(model._params)
    cache_len = ftjax.model.bucket(pos0 + new, 128)
    settings = (jnp.zeros(1, jnp.float32), jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.float32))
    keys, active = jax.random.PRNGKey(0)[None], np.ones(1, bool)
    out = []
    for rep in range(2):  # rep 0 compiles and warms
        state, xs, token = init_state(cfg, 1, cache_len), {}, jnp.zeros((1,), jnp.int32)
        stamps = []
        for i in range(new):
            token, _, state, xs, _ = steps.decode(params, state, xs, model._pool_dev, token,
                                                  np.array([pos0 + i], np.int32), active, keys,
                                                  np.array([i], np.int32), *settings)
            int(token[0])
            stamps.append(time.perf_counter())
        out = list(np.diff(stamps))
    return out


def frequency_of(model) -> np.ndarray:
    cfg = model.config
    freq = np.zeros((cfg.num_moe_layers, cfg.num_experts), np.int64)
    for r in model.expert_log():
        freq[r["layer"], r["selected"]] += 1
    return freq


# ------------------------------------------------------------------------------ tiny model

TINY = dict(num_hidden_layers=8, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=96,
            max_position_embeddings=256)


def build_tiny(root: Path) -> dict[str, Path]:
    sys.path.insert(0, str(REPO / "tests"))
    import hf_models  # the test suite's builder of tiny random HF checkpoints

    K, F, L = TINY["num_experts_per_tok"], TINY["moe_intermediate_size"], TINY["num_hidden_layers"]
    # An all-dense model does not load (HostExpertPool.allocate with Lm = 0 fails its
    # alignment check), so the dense baseline keeps layer 0 MoE: 1 MoE + 7 dense.
    variants = {"moe": dict(mlp_only_layers=[]), "dense": dict(mlp_only_layers=list(range(1, L))),
                "one": dict(mlp_only_layers=[], num_hidden_layers=1)}
    out = {}
    for name, over in variants.items():
        hf = hf_models.build("qwen3_moe", seed=3, **{**TINY, "intermediate_size": K * F, **over})
        out[name] = hf_models.save(hf, root / name)
    return out


def bench_tiny(args) -> None:
    root = Path(tempfile.mkdtemp(prefix="ftjax-tiny-", dir="/tmp"))
    paths = build_tiny(root)
    prompt = [int(t) for t in np.random.RandomState(0).randint(0, TINY["vocab_size"], size=8)]
    new = args.steps + 1
    threads = args.threads or 1
    L = TINY["num_hidden_layers"]
    Lm, E = L, TINY["num_experts"]
    slots = Lm * E // 2
    base = dict(mode="tiny", model=TINY, prompt_tokens=len(prompt), steps=args.steps, threads=threads)

    def run(path, label, **kw):
        m = ftjax.load(path, threads=threads, **kw)
        ts, toks = step_times(m, prompt, new)
        return m, ts, toks

    _, dense_t, _ = run(paths["dense"], "dense")  # 1 MoE + 7 dense layers
    _, one_t, _ = run(paths["one"], "one")  # 1 MoE layer
    dev, dev_t, ref_toks = run(paths["moe"], "device", policy="device")
    t_dense, t_one, t_dev = (statistics.median(t) for t in (dense_t, one_t, dev_t))
    per_dense_layer = (t_dense - t_one) / (L - 1)
    moe_overhead_dev = (t_dev - t_dense) / (L - 1)
    fixed = t_one - per_dense_layer - moe_overhead_dev  # t_one = fixed + dense layer + MoE overhead
    emit("decode_tiny_baseline", **base, step_ms_1moe_7dense=med_ms(dense_t), step_ms_1layer_moe=med_ms(one_t),
         per_dense_layer_us=round(per_dense_layer * 1e6, 2), fixed_per_step_us=round(fixed * 1e6, 2),
         p90_ms_1moe_7dense=round(float(np.percentile(dense_t, 90)) * 1e3, 4))

    freq = frequency_of(dev)
    configs = [("device", {}), ("host", {}),
               ("lru", dict(cache_slots=slots, bandwidth=(10.0, 20.0))),
               ("lru-transfer-only", dict(cache_slots=slots)), ("lru-host-only", dict(cache_slots=slots)),
               ("static-layer", dict(cache_slots=slots)), ("static-frequency", dict(cache_slots=slots, frequency=freq))]
    for policy, kw in configs:
        if policy == "device":
            m, ts, toks = dev, dev_t, ref_toks
        else:
            m, ts, toks = run(paths["moe"], policy, policy=policy, **kw)
        st = m.stats()
        step = statistics.median(ts)
        emit("decode_tiny", **base, policy=policy, cache_slots=kw.get("cache_slots"),
             bandwidth=kw.get("bandwidth"), tok_per_s=round(1 / step, 1), step_ms=med_ms(ts),
             p90_ms=round(float(np.percentile(ts, 90)) * 1e3, 4),
             overhead_per_moe_layer_us=round((step - t_dense) / (Lm - 1) * 1e6, 2),
             same_tokens_as_device=toks == ref_toks,
             hits=st["hits"], fetched=st["fetched"], host_computed=st["host_computed"])


# ------------------------------------------------------------------------------ real geometry

def micro(cfg, pool, threads: int) -> dict:
    """Jitted parts of a decode step with the model's shapes; ms and GB/s."""
    D, V, H, G, hd = cfg.d_model, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    K, E = cfg.top_k, pool.num_experts
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, D), dtype=np.float32))
    res = {}

    def rec(name, fn, args, nbytes, iters=20):
        ts = timed(jax.jit(fn), *args, iters=iters)
        res[name] = {"ms": med_ms(ts), "gbps": round(nbytes / statistics.median(ts) / 1e9, 2), "bytes": int(nbytes)}

    rec("dispatch_trivial_jit", lambda a: a + 1, (jnp.int32(0),), 0, iters=200)
    w32 = rng.standard_normal((D, V), dtype=np.float32) * 0.02
    bits = (w32.view(np.uint32) >> 16).astype(np.uint16)
    W32 = jnp.asarray(w32)
    rec("lm_head_f32_[D,V]", lambda x, w: x @ w, (x, W32), w32.nbytes)
    W32T = jnp.asarray(np.ascontiguousarray(w32.T))
    del w32
    rec("lm_head_f32_[V,D]", lambda x, w: w @ x[0], (x, W32T), W32T.nbytes)
    del W32, W32T
    Wb = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.bfloat16)
    rec("lm_head_bf16_dot_f32acc", lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32),
        (x, Wb), bits.nbytes)
    rec("lm_head_bf16_as_f32", lambda x, w: x @ w.astype(jnp.float32), (x, Wb), bits.nbytes)
    Wu = jnp.asarray(bits)
    rec("lm_head_u16bits_as_f32", lambda x, w: x @ as_f32(w), (x, Wu), bits.nbytes)
    WuT = jnp.asarray(np.ascontiguousarray(bits.T))
    WbT = jax.lax.bitcast_convert_type(WuT, jnp.bfloat16)
    rec("lm_head_bf16_[V,D]_f32acc", lambda x, w: jnp.dot(w, x[0].astype(jnp.bfloat16), preferred_element_type=jnp.float32),
        (x, WbT), bits.nbytes)
    rec("lm_head_packed_host_kernel", ftjax.host.linear, (x, WuT), bits.nbytes)  # what packed models run
    del Wb, Wu, WbT, WuT, bits

    logits = jnp.asarray(rng.standard_normal((1, V), dtype=np.float32))
    from ftjax.engine.sampling import sample
    rec("sample_greedy_V", lambda l: sample(l, jax.random.PRNGKey(0)[None], jnp.float32(0), jnp.int32(0), jnp.float32(1)),
        (logits,), V * 4)
    emb = jnp.asarray(rng.standard_normal((V, D), dtype=np.float32))
    rec("embed_gather", lambda e, t: e[t], (emb, jnp.array([[5]], jnp.int32)), D * 4)
    del emb

    attn = [jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.02)
            for s in ((D, H * hd), (D, G * hd), (D, G * hd), (H * hd, D))]
    abytes = sum(a.size * 4 for a in attn)

    def proj(x, wq, wk, wv, wo):
        q, k, v = x @ wq, x @ wk, x @ wv
        return q[:, :D] + k.sum() + v.sum() + (q @ wo)
    rec("attn_proj_f32_one_layer", proj, (x, *attn), abytes)
    attn_b = [a.astype(jnp.bfloat16) for a in attn]

    def proj_b(x, wq, wk, wv, wo):
        xb = x.astype(jnp.bfloat16)
        f = lambda a, w: jnp.dot(a, w, preferred_element_type=jnp.float32)  # noqa: E731
        q, k, v = f(xb, wq), f(xb, wk), f(xb, wv)
        return q[:, :D] + k.sum() + v.sum() + f(q.astype(jnp.bfloat16), wo)
    rec("attn_proj_bf16_one_layer", proj_b, (x, *attn_b), abytes // 2)
    del attn, attn_b

    # routed experts of one layer, top-K distinct, weights from the pool (uint16 bf16 bits)
    ids = jnp.asarray(rng.choice(E, K, replace=False)[None].astype(np.int32))  # [1, K]
    wts = jnp.full((1, K), 1.0 / K, jnp.float32)
    gu, dn = jnp.asarray(pool.gate_up[0]), jnp.asarray(pool.down[0])  # [E, 2F, D], [E, D, F]
    ebytes = K * pool.expert_bytes
    rec("experts_device_path_one_layer", lambda g, d, x, i, w: device_ffn(g, d, x, i, w), (gu, dn, x, ids, wts), ebytes)
    from ftjax.host import HostExecutor, read_bandwidth_gbps
    hx = HostExecutor(pool, threads=threads)
    rec("experts_host_ffi_one_layer", lambda x, i, w: hx.expert_ffn(x, 0, i, w), (x, ids, wts), ebytes)
    res["read_ceiling_gbps"] = round(read_bandwidth_gbps(threads), 2)
    return res


def bench_model(args) -> None:
    threads = args.threads or len(os.sched_getaffinity(0))
    rng = np.random.RandomState(0)
    results = {}
    base = dict(mode="geometry", model_dir=args.model, prompt_tokens=args.prompt, new_tokens=args.new,
                threads=threads, greedy=True)
    # Read the checkpoint once and reuse it for every policy (loading 6 GB takes minutes on
    # this shared machine); ftjax.load is otherwise used unchanged.
    t0 = time.perf_counter()
    ckpt = ftjax.checkpoint.load_checkpoint(args.model)
    ckpt_s = time.perf_counter() - t0
    # each load takes (and empties) its own params dict; arrays and pool are shared
    ftjax.model.load_checkpoint = lambda *a, **k: dataclasses.replace(ckpt, params=dict(ckpt.params))
    for policy, numerics in [(p, n) for p in args.policies for n in args.numerics]:
        kw = {"numerics": numerics}
        if policy not in ("device", "host"):
            kw["cache_slots"] = args.cache_slots
        if args.bandwidth:
            kw["bandwidth"] = tuple(args.bandwidth)
        t0 = time.perf_counter()
        m = ftjax.load(args.model, policy=policy, threads=threads, **kw)
        load_s = time.perf_counter() - t0
        prompt = [int(t) for t in rng.randint(0, m.config.vocab_size, size=args.prompt)]
        t0 = time.perf_counter()
        list(m.generate_stream(prompt, args.new))
        first_s = time.perf_counter() - t0
        m.reset_stats()
        stamps, cpu, toks = [], [], []
        for tok in m.generate_stream(prompt, args.new):
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
            toks.append(tok)
        ts = list(np.diff(stamps))
        cpu_ms = (cpu[-1] - cpu[0]) / (len(cpu) - 1) * 1e3  # process CPU time per token (all threads)
        st, g = m.stats(), m.last_generation
        results[policy] = statistics.median(ts)
        emit("decode_geometry", **base, policy=policy, numerics=m.numerics, host_isa=st["host_isa"],
             cache_slots=kw.get("cache_slots"),
             bandwidth_gbps=list(m.bandwidth) if m.bandwidth else None, load_s=round(load_s, 2),
             checkpoint_read_s=round(ckpt_s, 1), rss_gib=rss_gib(), peak_rss_gib=peak_rss_gib(),
             first_run_s_incl_compile=round(first_s, 2), ttft_ms=round(g.ttft_s * 1e3, 2),
             prefill_tok_per_s=round(args.prompt / g.ttft_s, 1),
             tok_per_s=round(1 / statistics.median(ts), 3), tok_per_s_mean=round(g.decode_tok_per_s, 3),
             step_ms=med_ms(ts), p90_ms=round(float(np.percentile(ts, 90)) * 1e3, 3),
             cpu_ms_per_token=round(cpu_ms, 3), hits=st["hits"], fetched=st["fetched"], host_computed=st["host_computed"],
             distinct_tokens=len(set(toks)))
        if policy == args.policies[0] and numerics == args.numerics[0] and not args.no_breakdown:
            nx = step_times_without_experts(m, args.new, args.prompt)
            parts = micro(m.config, m.checkpoint.pool, threads)
            cfg = m.config
            emit("decode_geometry_breakdown", **base, policy=policy, step_ms=med_ms(ts),
                 step_ms_without_experts=med_ms(nx), experts_ms=round((results[policy] - statistics.median(nx)) * 1e3, 3),
                 num_layers=cfg.num_layers, parts=parts)
        del m


def bench_micro(args) -> None:
    """The micro-benchmarks alone, on the checkpoint's config and a synthetic 1-layer pool
    (no checkpoint read: a few GB of memory instead of ~18)."""
    from ftjax.config import read_config_json
    from ftjax.experts.pool import HostExpertPool, to_bf16_bits
    from ftjax.models import config_from_hf

    threads = args.threads or len(os.sched_getaffinity(0))
    cfg = config_from_hf(read_config_json(args.micro))
    E = 2 * cfg.top_k
    pool = HostExpertPool.allocate(1, E, cfg.d_model, cfg.d_ff_expert, "bfloat16")
    rng = np.random.default_rng(0)
    for a in (pool.gate_up, pool.down):
        a[...] = to_bf16_bits((rng.standard_normal(a.shape, dtype=np.float32) * 0.02))
    pool.freeze()
    parts = micro(cfg, pool, threads)
    emit("decode_micro", mode="micro", model_dir=args.micro, threads=threads, parts=parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--tiny", action="store_true")
    mode.add_argument("--model", default=None)
    mode.add_argument("--micro", default=None, metavar="DIR", help="micro-benchmarks only, with DIR's config")
    ap.add_argument("--threads", type=int, default=None, help="cores to pin to / host kernel threads")
    ap.add_argument("--steps", type=int, default=200, help="--tiny: measured decode steps")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--policies", nargs="+", default=["device", "host", "lru"])
    ap.add_argument("--numerics", nargs="+", default=["auto"], choices=["auto", "exact", "fast"],
                    help="--model: each policy under each (fast: AMX expert prefill where the CPU has it)")
    ap.add_argument("--cache-slots", type=int, default=128)
    ap.add_argument("--bandwidth", type=float, nargs=2, default=None, metavar=("B_P", "B_H"))
    ap.add_argument("--no-breakdown", action="store_true")
    add_allow_dirty_argument(ap)
    args = ap.parse_args()
    check_clean_or_exit(args.allow_dirty)
    bench_tiny(args) if args.tiny else bench_micro(args) if args.micro else bench_model(args)


if __name__ == "__main__":
    main()
