"""Expert parallelism against one device, for `test_mesh.py` (run in a process of its own:
the forced host devices must be set before JAX starts).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \
        python tests/mesh_check.py OUT.jsonl --families qwen3_moe,deepseek_v3 --policies device,lru --devices 2,4

For each family's tiny checkpoint (`hf_models`; deepseek_v4 from its own test's builder)
and each policy, the one-device model is the reference; on each device count it writes
one JSON line: the prompt's logits' relative error, whether 8 greedy tokens are equal,
and whether each device's cache holds only experts it owns, at most its slots.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

import ftjax
import hf_models
from ftjax.experts.policy import POLICIES

PROMPT = [3, 17, 42, 5, 9, 77, 23, 61, 8, 30, 14, 2]
NEW = 8
SLOTS = 5  # per device: small enough that misses, evictions and host work all happen


def build(family: str):
    if family == "deepseek_v4":
        import test_deepseek_v4
        return test_deepseek_v4.build()
    return hf_models.build(family)


def cache_respects_ownership(model) -> bool:
    """Each device's slots hold only experts it owns (e % P == d), at most its slots."""
    xs = model._xstate
    if "id_of_slot" not in xs:
        return True
    table = np.asarray(xs["id_of_slot"])  # [P, slots]
    E, P = model.config.num_experts, table.shape[0]
    ok = table.shape[1] == model._steps.executor.slots
    for d in range(P):
        held = table[d][table[d] >= 0]
        ok &= bool(np.all(held % E % P == d))
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--families", default=",".join(sorted(hf_models.FAMILY_CONFIGS)) + ",deepseek_v4")
    ap.add_argument("--policies", default="device,lru")
    ap.add_argument("--devices", default="2,4")
    a = ap.parse_args(argv)
    counts = [int(n) for n in a.devices.split(",")]
    if len(jax.devices()) < max(counts):
        sys.exit(f"needs {max(counts)} devices, JAX sees {len(jax.devices())} (set XLA_FLAGS first)")
    with open(a.out, "w") as out, tempfile.TemporaryDirectory() as tmp:
        for family in a.families.split(","):
            path = hf_models.save(build(family), Path(tmp) / family)
            for policy in a.policies.split(","):
                kw = {"numerics": "exact", "policy": policy}
                if POLICIES[policy].uses_slots:
                    kw.update(cache_slots=SLOTS, bandwidth=(1.0, 1.0))
                if policy == "static-frequency":  # pinned by made-up selection counts
                    cfg = ftjax.load(path, numerics="exact").config
                    kw["frequency"] = np.random.RandomState(0).randint(0, 9, (cfg.num_moe_layers, cfg.num_experts))
                one = ftjax.load(path, **kw)
                want_logits, want_tokens = one.logits(PROMPT), one.generate(PROMPT, NEW)
                for n in counts:
                    model = ftjax.load(path, devices=n, **kw)
                    logits = model.logits(PROMPT)
                    tokens = model.generate(PROMPT, NEW)
                    rel = float(np.abs(logits - want_logits).max() / np.abs(want_logits).max())
                    stats = model.stats()
                    line = {"family": family, "policy": policy, "devices": n, "rel": rel,
                            "tokens_equal": tokens == want_tokens, "ownership": cache_respects_ownership(model),
                            "per_device": stats["devices"]}
                    out.write(json.dumps(line) + "\n")
                    out.flush()
                    print(json.dumps({k: line[k] for k in ("family", "policy", "devices", "rel", "tokens_equal")}),
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
