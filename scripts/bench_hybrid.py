"""Gated DeltaNet hybrids (Qwen3.6-35B-A3B geometry): prefill against prompt length, and
decode under `host` and `lru`.

Prints JSON lines (commit and machine fields on each):
- `deltanet_layer`: one Gated DeltaNet layer of the checkpoint (its real weights, jitted,
  chunked delta rule) on T = 512 / 2k / 8k tokens: ms and µs per token. Linear growth
  means µs/token stays flat.
- `hybrid_prefill`: the whole model's prefill (`Session.append`) of T random token ids:
  tok/s (compiled first on a throwaway session of the same length).
- `hybrid_decode`: greedy decode of `--new` tokens after a 64-token prompt, per policy:
  steady tok/s (first step apart), TTFT, expert-cache counters.

    python scripts/make_geometry_checkpoint.py --family qwen3_5_moe --out /tmp/geom-q36 --layers 4
    python scripts/bench_hybrid.py --model /tmp/geom-q36 [--prompts 512 2048 8192] [--policies host lru]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ftjax  # noqa: E402
from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields  # noqa: E402,E501


def emit(record: dict) -> None:
    print(json.dumps({**record, **commit_info(), **machine_info(), **run_fields()}), flush=True)


def deltanet_layer_times(model, lengths: list[int], repeats: int = 3) -> None:
    """One DeltaNet layer in isolation: the real module with the checkpoint's weights."""
    from flax import nnx

    from ftjax.models.common import CausalLM
    from ftjax.models.ops import Step

    layer = next(i for i, k in enumerate(model.config.layer_kinds) if k == "gated_deltanet")
    lm = nnx.merge(model._graphdef, model._params) if hasattr(model, "_graphdef") else None
    if lm is None:
        raise SystemExit("model has no graphdef to rebuild its modules from")
    mixer = lm.layers[layer].attn
    graphdef, params = nnx.split(mixer)
    cfg = model.config

    @jax.jit
    def run(params, x, state):
        module = nnx.merge(graphdef, params)
        B, T, _ = x.shape
        valid = jnp.ones((B, T), bool)
        step = Step(jnp.arange(T, dtype=jnp.int32)[None], jnp.zeros((B,), jnp.int32), valid, (None, None))
        return module(x, step, state)

    rng = np.random.default_rng(0)
    for T in lengths:
        x = jnp.asarray(rng.normal(size=(1, T, cfg.d_model)), jnp.float32)
        state = type(mixer).init_state(cfg, layer, 1, T)
        jax.block_until_ready(run(params, x, state))  # compile
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(run(params, x, state))
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        emit({"bench": "deltanet_layer", "model": model.checkpoint.path.name, "layer": layer, "tokens": T,
              "ms": round(ms, 1), "us_per_token": round(ms * 1e3 / T, 1), "repeats": repeats})


def prefill(model, lengths: list[int]) -> None:
    rng = np.random.default_rng(1)
    V = model.config.vocab_size
    for T in lengths:
        ids = rng.integers(0, V, T).tolist()
        model.session().append(ids)  # compile this length's buckets
        s = model.session()
        t0 = time.perf_counter()
        s.append(ids)
        dt = time.perf_counter() - t0
        emit({"bench": "hybrid_prefill", "model": model.checkpoint.path.name, "policy": model.policy,
              "tokens": T, "seconds": round(dt, 2), "tok_per_s": round(T / dt, 1),
              "prefill_chunk": model.prefill_chunk})


def decode(path: str, policies: list[str], new: int, threads: int | None, cache_slots: int) -> None:
    rng = np.random.default_rng(2)
    for policy in policies:
        slots = {"cache_slots": cache_slots} if policy not in ("host", "device") else {}
        model = ftjax.load(path, policy=policy, threads=threads, **slots)
        ids = rng.integers(0, model.config.vocab_size, 64).tolist()
        model.generate(ids, 4)  # compile
        model.reset_stats()
        s = model.session()
        t0 = time.perf_counter()
        s.generate(new, prompt=ids)
        wall = time.perf_counter() - t0
        g, st = s.last_generation, model.stats()
        emit({"bench": "hybrid_decode", "model": model.checkpoint.path.name, "policy": policy,
              "cache_slots": st.get("cache_slots"), "prompt_tokens": len(ids), "new_tokens": new, "ttft_s": round(g.ttft_s, 3),
              "decode_tok_per_s": round(g.decode_tok_per_s, 2), "wall_s": round(wall, 2),
              "hits": st["hits"], "misses": st["misses"], "fetched": st["fetched"],
              "host_computed": st["host_computed"], "threads": threads})
        del model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", nargs="+", type=int, default=[512, 2048, 8192])
    ap.add_argument("--policies", nargs="+", default=["host", "lru"])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-slots", type=int, default=256, help="device expert cache of the cache policies")
    ap.add_argument("--skip", nargs="*", default=[], choices=["layer", "prefill", "decode"])
    add_allow_dirty_argument(ap)
    a = ap.parse_args(argv)
    check_clean_or_exit(a.allow_dirty)
    if "layer" not in a.skip or "prefill" not in a.skip:
        model = ftjax.load(a.model, policy="host", threads=a.threads)
        if "layer" not in a.skip:
            deltanet_layer_times(model, a.prompts)
        if "prefill" not in a.skip:
            prefill(model, a.prompts)
        del model
    if "decode" not in a.skip:
        decode(a.model, a.policies, a.new, a.threads, a.cache_slots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
