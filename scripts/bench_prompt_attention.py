"""Prompt attention per path: one layer's attention for a prompt chunk on the CPU.

For each head geometry (the default model's, Qwen3-30B-A3B's, OLMoE-1B-7B's), chunk of
T query tokens and keys before it (a prompt's first chunk: from position 0; a chunk
appended to a long history: the last T of --context keys), bf16 K/V cache [1, G, S, hd],
the same call timed three ways:
    tiles   ftjax.host.attention under the tile ISA numerics="fast" runs here
            (host_kernels/attention_tiles.cc: AMX_BF16 on an AMX CPU, else the vector form
            AVX512_BF16_TILES; q, k, v and the softmax weights in bf16; `tiles_isa`), at
            each --threads
    exact   the same entry under AUTO (the exact f32 kernel decode uses), at each --threads
    xla     ftjax.models.layers.blocked_attention, jitted (f32; what a prompt ran before,
            and what it runs without either or under numerics="exact"), on XLA's own pool:
            every core the process may run on (`xla_threads`)
Median of --rounds after a warm-up; one JSON line per (geometry, chunk), times in ms
(tiles: CANNOT TEST where the CPU has neither AMX-BF16 tiles nor AVX512-BF16).

    OPENBLAS_NUM_THREADS=1 python scripts/bench_prompt_attention.py [--threads 1 2] [--context 16384]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import numpy as np
from bench_expert_prefill import timed

from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields

def median_ms(fn, rounds: int) -> float:
    """Median ms of `rounds` calls after a warm-up (`bench_expert_prefill.timed`)."""
    return round(1e3 * statistics.median(timed(fn, rounds)), 2)


GEOMETRIES = {"ftjax-default": (4, 2, 64), "qwen3-30b-a3b": (32, 4, 128), "olmoe-1b-7b": (16, 16, 128)}  # H, G, hd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--context", type=int, default=16384, help="keys before an appended chunk")
    ap.add_argument("--chunks", type=int, nargs="+", default=[512, 4096], help="query tokens of a chunk")
    ap.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    ap.add_argument("--rounds", type=int, default=3)
    add_allow_dirty_argument(ap)
    a = ap.parse_args(argv)
    check_clean_or_exit(a.allow_dirty)

    import jax
    import jax.numpy as jnp

    from ftjax import host
    from ftjax.experts.storage import to_bf16_bits
    from ftjax.models.layers import blocked_attention

    xla = jax.jit(blocked_attention)
    tile_isa = host.expert_isa("fast")
    tiles_status = "" if tile_isa in host.tile_isas() else \
        f"CANNOT TEST: no AMX-BF16 tiles ({host.amx_bf16_status()}), no vector form ({host.bf16_vector_status()})"
    rng = np.random.default_rng(0)
    for name in a.geometries:
        H, G, hd = GEOMETRIES[name]
        for T in a.chunks:
            for where in ("first", "appended"):
                start = 0 if where == "first" else a.context
                S = start + T
                k, v = (to_bf16_bits(rng.standard_normal((1, G, S, hd)).astype(np.float32)) for _ in range(2))
                kj, vj = (jnp.asarray(x.view(jnp.bfloat16)) for x in (k, v))
                q = rng.standard_normal((1, T, H, hd)).astype(np.float32)
                positions, kv_len = (start + np.arange(T, dtype=np.int32))[None], np.array([S], np.int32)
                on_device = [jnp.asarray(x) for x in (q, positions, kv_len)]

                def host_ms(isa, threads):
                    return median_ms(lambda: host.attention_numpy(q, k, v, positions, kv_len, threads=threads, isa=isa),
                                     a.rounds)

                xla_ms = median_ms(lambda: xla(on_device[0], kj, vj, *on_device[1:]).block_until_ready(), a.rounds)
                tiles = {str(n): host_ms(tile_isa, n) for n in a.threads} if tiles_status == "" else tiles_status
                line = {"bench": "prompt_attention", "geometry": name, "heads": H, "kv_heads": G, "head_dim": hd,
                        "tokens": T, "chunk": where, "keys": S, "kv_dtype": "bfloat16", "tiles_ms": tiles,
                        "tiles_isa": tile_isa.name.lower(),
                        "exact_ms": {str(n): host_ms(host.Isa.AUTO, n) for n in a.threads}, "xla_ms": xla_ms,
                        "xla_threads": len(os.sched_getaffinity(0)), "rounds": a.rounds,
                        **commit_info(), **machine_info(), **run_fields()}
                print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
