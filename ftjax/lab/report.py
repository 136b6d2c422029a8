"""Report helpers: the cache-policy JSON, PNG plots and markdown tables.

Artifacts (names are what the experiment scripts and docs expect):
  cache_policies.json  {"results": [{"policy", "cache_fraction", "miss_rate"}, ...]}
  miss_rate.png        miss rate vs cache fraction, one line per policy
  q_sweep.png          layer time vs q per machine, q* and the argmin marked
  decode_tok_s.png     simulated decode tok/s, bars grouped by machine, one per policy
`write_policy_report` produces all of them (plus report.md) for one trace.
matplotlib is imported lazily (Agg backend) so the lab itself needs only numpy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from ftjax.lab.geometry import ModelGeometry
from ftjax.lab.machines import PAPER_MACHINES, HardwareProfile
from ftjax.lab.policies import OUR_POLICY, POLICIES, miss_rate_curve
from ftjax.lab.simulator import QSweep, q_sweep, simulate_decode
from ftjax.lab.trace import Trace

RESULT_KEYS = ("policy", "cache_fraction", "miss_rate")
REQUIRED_POLICIES = ("lru", "belady", "lru-per-layer", "lfu", "static-frequency", "static-layer")
DECODE_POLICIES = ("lru", OUR_POLICY, "lru-transfer-only", "static-frequency", "static-layer")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# -- JSON ----------------------------------------------------------------------------


def write_cache_policies_json(results: Iterable[Mapping], path: str | Path) -> dict:
    """Write {"results": [...]} with exactly the keys policy, cache_fraction, miss_rate."""
    rows = [
        {
            "policy": str(r["policy"]),
            "cache_fraction": float(r["cache_fraction"]),
            "miss_rate": float(r["miss_rate"]),
        }
        for r in results
    ]
    doc = {"results": rows}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def check_cache_policies_json(doc: Mapping) -> list[str]:
    """Problems with a cache_policies document (empty list: valid)."""
    problems = []
    rows = doc.get("results")
    if not isinstance(rows, list) or not rows:
        return ["'results' must be a non-empty list"]
    for i, row in enumerate(rows):
        if set(row) != set(RESULT_KEYS):
            problems.append(f"row {i} keys {sorted(row)} != {sorted(RESULT_KEYS)}")
        elif not (0.0 <= row["miss_rate"] <= 1.0 and 0.0 <= row["cache_fraction"] <= 1.0):
            problems.append(f"row {i} out of range: {row}")
    names = {row.get("policy") for row in rows}
    problems += [f"policy {p!r} missing" for p in REQUIRED_POLICIES if p not in names]
    return problems


# -- plots ---------------------------------------------------------------------------


def plot_miss_rates(results: Sequence[Mapping], path: str | Path, title: str = "") -> None:
    """Miss rate vs cache fraction, one line per policy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in dict.fromkeys(r["policy"] for r in results):
        pts = sorted((r["cache_fraction"], r["miss_rate"]) for r in results if r["policy"] == name)
        style = "-" if POLICIES.get(name) is None or POLICIES[name].kind == "dynamic" else "--"
        width = 2.5 if name == OUR_POLICY else 1.5
        ax.plot(*zip(*pts), style, marker="o", ms=3, lw=width, label=name)
    ax.set(xlabel="cache size (fraction of all experts)", ylabel="miss rate", ylim=(0, 1.02))
    ax.set_title(title or "expert-cache miss rate (decode)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_q_sweep(sweeps: Mapping[str, QSweep], path: str | Path) -> None:
    """Layer time vs q per machine (ms), q* (circle) and the argmin (cross) marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, sweep in sweeps.items():
        qs = [q for q, s in sweep.points if s != float("inf")]
        ms = [s * 1e3 for _, s in sweep.points if s != float("inf")]
        (line,) = ax.plot(qs, ms, marker=".", label=f"{name} (q*={sweep.q_star}, best={sweep.best_q})")
        ax.plot([sweep.q_star], [sweep.q_star_s * 1e3], "o", mfc="none", ms=10, color=line.get_color())
        ax.plot([sweep.best_q], [sweep.best_s * 1e3], "x", ms=9, color=line.get_color())
    m = next(iter(sweeps.values())).m if sweeps else 0
    ax.set(xlabel=f"q = misses transferred (of m = {m})", ylabel="MoE layer time (ms)")
    ax.set_title("bandwidth split: o = q* = m B_P / B_H, x = argmin")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_decode_bars(rows: Sequence[Mapping], path: str | Path, title: str = "") -> None:
    """Simulated tok/s: groups = machines, bars = policies."""
    plt = _pyplot()
    machines = list(dict.fromkeys(r["machine"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    value = {(r["machine"], r["policy"]): r["tok_per_s"] for r in rows}
    width = 0.8 / max(1, len(policies))
    fig, ax = plt.subplots(figsize=(max(6.4, 1.3 * len(machines) + 2), 4.2))
    for j, policy in enumerate(policies):
        xs = [i + (j - (len(policies) - 1) / 2) * width for i in range(len(machines))]
        ax.bar(xs, [value.get((m, policy), 0.0) for m in machines], width, label=policy)
    ax.set_xticks(range(len(machines)), machines, rotation=15, fontsize=8)
    ax.set(ylabel="simulated decode tok/s")
    ax.set_title(title or "simulated decode throughput")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- markdown ------------------------------------------------------------------------


def markdown_table(rows: Sequence[Sequence], header: Sequence[str], floatfmt: str = ".3f") -> str:
    """A GitHub markdown table; floats formatted with `floatfmt`."""

    def cell(x):
        return format(x, floatfmt) if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def miss_rate_table(results: Sequence[Mapping]) -> str:
    """Policies as rows, cache fractions as columns."""
    fractions = sorted({r["cache_fraction"] for r in results})
    policies = list(dict.fromkeys(r["policy"] for r in results))
    rate = {(r["policy"], r["cache_fraction"]): r["miss_rate"] for r in results}
    rows = [[p] + [rate.get((p, f), float("nan")) for f in fractions] for p in policies]
    return markdown_table(rows, ["policy"] + [f"{f:g}" for f in fractions])


def decode_table(rows: Sequence[Mapping]) -> str:
    """Machines as rows, policies as columns, simulated tok/s (and the cache size if known)."""
    machines = list(dict.fromkeys(r["machine"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    value = {(r["machine"], r["policy"]): r["tok_per_s"] for r in rows}
    cache = {r["machine"]: r["cache_fraction"] for r in rows if "cache_fraction" in r}
    body = [[m] + [value.get((m, p), float("nan")) for p in policies] for m in machines]
    header = ["machine"] + policies
    if cache:
        body = [row + [f"{cache.get(row[0], float('nan')):.0%}"] for row in body]
        header.append("cache")
    return markdown_table(body, header, ".1f")


# -- one-call report -----------------------------------------------------------------


def write_policy_report(
    trace: Trace,
    out_dir: str | Path,
    *,
    fractions: Sequence[float] = (0.05, 0.1, 0.2, 0.3, 0.5),
    geometry: ModelGeometry | None = None,
    machines: Mapping[str, HardwareProfile] = PAPER_MACHINES,
    decode_fraction: float | None = None,
    reserved_gib: float = 2.0,
    decode_policies: Sequence[str] = DECODE_POLICIES,
    q_misses: int = 8,
    warmup_prefill: bool = False,
    warmup_tokens: int = 0,
) -> dict:
    """Miss-rate curves, q sweeps and (with a geometry) simulated decode for one trace.

    Decode cache size: `decode_fraction` of all experts on every machine, or (None)
    what fits each machine's VRAM after the non-expert weights and `reserved_gib`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = miss_rate_curve(trace, fractions=fractions, warmup_prefill=warmup_prefill)
    write_cache_policies_json(results, out / "cache_policies.json")
    plot_miss_rates(results, out / "miss_rate.png", f"miss rate: {trace.meta.get('model', 'trace')}")

    expert_bytes = geometry.expert_bytes if geometry else 3 * 2048 * 768 * 2
    sweeps = {name: q_sweep(q_misses, hw, expert_bytes) for name, hw in machines.items()}
    plot_q_sweep(sweeps, out / "q_sweep.png")

    md = ["# Expert-cache policy lab\n", miss_rate_table(results)]
    q_rows = [[name, s.q_star, s.best_q] for name, s in sweeps.items()]
    md.append(markdown_table(q_rows, ["machine", "q*", "argmin q"]))
    decode_rows = []
    if geometry is not None:
        for hw in machines.values():
            if decode_fraction is not None or hw.device_mem_gib is None:
                slots = int(round((decode_fraction or 0.2) * geometry.num_expert_slots_total))
            else:
                slots = geometry.slots_that_fit(hw.device_mem_gib, reserved_gib)
            for policy in decode_policies:
                r = simulate_decode(
                    trace, policy, slots, hw, geometry,
                    warmup_prefill=warmup_prefill, warmup_tokens=warmup_tokens,
                )
                keys = ("machine", "policy", "slots", "cache_fraction", "tok_per_s", "miss_rate")
                decode_rows.append({k: r[k] for k in keys})
        plot_decode_bars(decode_rows, out / "decode_tok_s.png")
        md.append(decode_table(decode_rows))
    (out / "report.md").write_text("\n".join(md))
    return {"results": results, "q_sweeps": sweeps, "decode": decode_rows}
