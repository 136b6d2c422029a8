"""The accelerator benchmark of `scripts/gpu_check.sh`: one JSON line per measurement.

- decode: tok/s with the expert cache capped to 25% of all experts (`lru`, calibrated
  split), beside the roofline of that run: the bytes each token had to move or read
  (fetched experts over the link at the measured B_P, host experts at B_H, the other
  weights and the KV at device bandwidth are left out: a lower bound on time), and the
  measured profile B_P / B_H with the live estimates after the run.
- prefill: a streamed prefill's T_prefill vs T_transfer, T_compute, max and sum of the
  two (`ftjax.bench.prefill.prefill_overlap`).
Runs on any backend (the CPU backend for `gpu_check.sh --dry-run`).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

import ftjax
from ftjax.bench.prefill import prefill_overlap
from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields


def emit(record: dict) -> None:
    print(json.dumps({**record, **commit_info(), "machine": machine_info(), "backend": jax.default_backend(),
                      **run_fields()}), flush=True)


def model_config(path: str | None):
    """The config alone for a checkpoint folder (None: the embedded model); a .gguf file
    carries it inside, so that one is loaded."""
    if path is not None and path.endswith(".gguf"):
        return ftjax.load(path).config
    from ftjax.config import read_config_json
    from ftjax.model import DEFAULT_MODEL_DIR
    from ftjax.models import config_from_hf

    return config_from_hf(read_config_json(path or DEFAULT_MODEL_DIR))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: the embedded model)")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens of the prefill breakdown")
    add_allow_dirty_argument(ap)
    args = ap.parse_args()
    check_clean_or_exit(args.allow_dirty)

    cfg = model_config(args.model)
    slots = max(1, cfg.num_moe_layers * cfg.num_experts // 4)
    model = ftjax.load(args.model, policy="lru", cache_slots=slots)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, 16).tolist()
    model.generate(prompt, args.tokens)  # compile + warm the cache
    model.reset_stats()
    t0 = time.perf_counter()
    new = model.generate(prompt, args.tokens)
    seconds = time.perf_counter() - t0
    st = model.stats()
    b_p, b_h = model.bandwidth
    per_token = len(new) or 1
    fetch_s = st["bytes_fetched"] / per_token / (b_p * 1e9)
    host_s = st["bytes_host"] / per_token / (b_h * 1e9)
    emit({"bench": "gpu_decode", "cache_slots": slots, "cache_share": slots / (cfg.num_moe_layers * cfg.num_experts),
          "tok_s": len(new) / seconds, "miss_rate": st["misses"] / max(1, st["selections"]),
          "roofline_tok_s": 1.0 / max(fetch_s, host_s, 1e-9), "B_P_gbps": b_p, "B_H_gbps": b_h,
          "live": st.get("bandwidth"), "placement": st["placement"]})
    ids = rng.integers(0, cfg.vocab_size, args.prompt).tolist()
    model.prefill_mode = "streamed"
    model.clear_expert_cache()  # as loaded: every non-resident expert crosses the link
    ov = prefill_overlap(model, ids)
    if ov.get("available"):
        emit({"bench": "gpu_prefill", "tokens": args.prompt, "t_prefill_s": ov["t_prefill_s"],
              "t_transfer_s": ov["t_transfer_s"], "t_compute_s": ov["t_compute_s"],
              "max_s": max(ov["t_transfer_s"], ov["t_compute_s"]), "sum_s": ov["t_transfer_s"] + ov["t_compute_s"],
              "overlap_ratio": ov["overlap_ratio"], "transfer_gbps": ov.get("transfer_gbps")})
    else:
        emit({"bench": "gpu_prefill", "available": False, "reason": ov.get("reason")})


if __name__ == "__main__":
    main()
