"""Decode cost against context length: ms per token at 1k, 4k, 16k, 32k tokens held.

A decode step's work depends on how many cached keys it must read, not on their values,
so each context is set up by giving the step a state of that capacity and a position of
that length (filling 32k tokens by prefill would take hours on a 2-core CPU); the step
is the model's real jitted decode step (`Model.decode_step`), with its real executor.
One JSON line per context with commit and machine fields: median ms/token over
`--steps` steps after a compile+warm-up round (x `--rounds`, the contexts taken in turn),
the bytes a step reads at least (`weight_bytes_read`: dense matrices and top-k experts,
`ftjax.bench.models.decode_weight_bytes`; `kv_bytes_read`: the K/V of the context;
`step_bytes_read`: both) and the achieved attention read rate. Between two contexts, the
ratio of their step bytes is the bytes bound of the slowdown: a step bound by memory
reads slows by that much, no less (scripts/results.py puts it beside the measured one).

    python scripts/bench_context.py --model DIR [--contexts 1024 4096 16384 32768] [--policy host]
        [--kv-dtype bfloat16] [--rounds 3]
        [--prefill 2048 8192 32768]
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
from ftjax.bench.models import decode_weight_bytes  # noqa: E402
from ftjax.engine.session import MIN_CAPACITY, bucket  # noqa: E402
from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields  # noqa: E402,E501


def step_times(model, context: int, steps: int) -> list[float]:
    cfg = model.config
    cap = bucket(context + steps + 1, MIN_CAPACITY)
    state = model.new_state(1, cap)
    settings = (jnp.zeros(1, jnp.float32), jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.float32))
    keys, active = jax.random.PRNGKey(0)[None], np.ones(1, bool)
    token = jnp.zeros((1,), jnp.int32)
    times = []
    for i in range(steps + 2):  # the first two compile and warm
        t0 = time.perf_counter()
        token, _, state = model.decode_step(state, token, np.array([context + i], np.int32), active, keys,
                                            np.array([i], np.int32), *settings)
        np.asarray(token)  # the step's one host sync, as the generation loop reads it
        times.append(time.perf_counter() - t0)
    return times[2:]


def prefill_time(model, tokens: int) -> float:
    """Seconds to prefill a `tokens`-token prompt of random ids in a fresh session (chunks
    of `model.prefill_chunk`), after one chunk at the same capacity has compiled the step."""
    ids = np.random.default_rng(tokens).integers(0, model.config.vocab_size, tokens).tolist()
    warm = model.session()
    warm.reserve(tokens)
    warm.append(ids[:min(tokens, model.prefill_chunk)])
    del warm
    s = model.session()
    s.reserve(tokens)
    t0 = time.perf_counter()
    s.append(ids)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096, 16384, 32768])
    ap.add_argument("--policy", default="host")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every context this many times, in turn (a shared VM's slow spells spread over all)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16"],
                    help="K/V storage (default: what the model's numerics choose: bf16 for a bf16 checkpoint)")
    ap.add_argument("--attention", default="auto", choices=["auto", "xla"],
                    help="auto: the host kernel where `models.layers.attend` picks it; xla: always blocked XLA")
    ap.add_argument("--prefill", nargs="*", type=int, default=[],
                    help="also time the prefill of prompts of these lengths (tok/s)")
    add_allow_dirty_argument(ap)
    a = ap.parse_args(argv)
    check_clean_or_exit(a.allow_dirty)
    if a.attention == "xla":
        from ftjax.models import layers

        layers.HOST_KERNEL_DECODE = False
    model = ftjax.load(a.model, policy=a.policy, threads=a.threads, kv_dtype=a.kv_dtype)
    cfg = model.config
    kv_layers = sum("k" in s for s in jax.eval_shape(lambda: model.new_state(1, 16)))  # attention layers only
    weight_bytes = sum(decode_weight_bytes(model))
    contexts = [c for c in a.contexts if c + a.steps + 1 <= model.max_seq_len]
    for ctx in sorted(set(a.contexts) - set(contexts)):
        print(json.dumps({"bench": "decode_context", "context": ctx, "skipped": f"beyond max_seq_len {model.max_seq_len}"}))
    times: dict[int, list[float]] = {c: [] for c in contexts}
    for _ in range(a.rounds):
        for ctx in contexts:
            times[ctx] += step_times(model, ctx, a.steps)
    for ctx in contexts:
        ms = statistics.median(times[ctx]) * 1e3
        kv_bytes = 2 * kv_layers * ctx * cfg.num_kv_heads * cfg.head_dim * np.dtype(model.kv_dtype).itemsize
        print(json.dumps({"bench": "decode_context", "model": model.checkpoint.path.name, "policy": a.policy,
                          "context": ctx, "ms_per_token": round(ms, 2), "weight_bytes_read": weight_bytes,
                          "kv_bytes_read": kv_bytes, "step_bytes_read": weight_bytes + kv_bytes,
                          "kv_dtype": jnp.dtype(model.kv_dtype).name, "attention": a.attention,
                          "kv_read_gbps_upper": round(kv_bytes / (ms / 1e3) / 1e9, 2),
                          "steps": a.steps, "rounds": a.rounds, "threads": a.threads, **commit_info(), **machine_info(),
                          **run_fields()}), flush=True)
    for tokens in a.prefill:
        if tokens > model.max_seq_len:
            print(json.dumps({"bench": "prefill_context", "tokens": tokens, "skipped": f"beyond max_seq_len {model.max_seq_len}"}))
            continue
        sec = prefill_time(model, tokens)
        print(json.dumps({"bench": "prefill_context", "model": model.checkpoint.path.name, "policy": a.policy,
                          "tokens": tokens, "seconds": round(sec, 2), "tok_per_s": round(tokens / sec, 1),
                          "prefill_chunk": model.prefill_chunk, "kv_dtype": jnp.dtype(model.kv_dtype).name,
                          "threads": a.threads,
                          **commit_info(), **machine_info(), **run_fields()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
