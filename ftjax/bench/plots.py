"""Plots of the paper bench that the lab's report helpers do not cover (matplotlib, Agg)."""

from __future__ import annotations


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def decode_figure(sim_rows: list[dict], validation: list[dict], path) -> None:
    """Left: simulated tok/s per machine and policy (one panel per geometry).
    Right: this machine, predicted vs measured tok/s of the validation runs."""
    plt = pyplot()
    geometries = list(dict.fromkeys(r["geometry"] for r in sim_rows))
    cols = len(geometries) + (1 if validation else 0)
    fig, axes = plt.subplots(1, cols, figsize=(6.0 * cols, 4.4), squeeze=False)
    for ax, geo in zip(axes[0], geometries):
        rows = [r for r in sim_rows if r["geometry"] == geo]
        machines = list(dict.fromkeys(r["machine"] for r in rows))
        policies = list(dict.fromkeys(r["policy"] for r in rows))
        value = {(r["machine"], r["policy"]): r["tok_per_s"] for r in rows}
        width = 0.8 / max(1, len(policies))
        for j, p in enumerate(policies):
            xs = [i + (j - (len(policies) - 1) / 2) * width for i in range(len(machines))]
            ax.bar(xs, [value.get((m, p), 0.0) for m in machines], width, label=p)
        ax.set_xticks(range(len(machines)), machines, rotation=20, fontsize=7)
        ax.set(ylabel="simulated decode tok/s", title=f"simulated: {geo}")
        ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    if validation:
        ax = axes[0][-1]
        labels = [f"{v['policy']}\n{v['slots']} slots" for v in validation]
        xs = range(len(validation))
        ax.bar([x - 0.2 for x in xs], [v["measured_tok_per_s"] for v in validation], 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [v["predicted_tok_per_s"] for v in validation], 0.4, label="predicted")
        for x, v in zip(xs, validation):
            tag = "calib." if v["calibration"] else f"{v['rel_err']:+.0%}"
            ax.annotate(tag, (x, max(v["measured_tok_per_s"], v["predicted_tok_per_s"])), ha="center",
                        va="bottom", fontsize=7)
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set(ylabel="decode tok/s", title="this machine: simulator vs measured")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def prefill_figure(result: dict, path) -> None:
    """T_transfer, T_compute, their max, streamed T_prefill (and the cached path if timed)."""
    plt = pyplot()
    names = ["T_transfer", "T_compute", "max(T_tr, T_c)", "T_prefill streamed", "T_transfer + T_compute"]
    vals = [result["t_transfer_s"], result["t_compute_s"], max(result["t_transfer_s"], result["t_compute_s"]),
            result["t_prefill_s"], result["t_transfer_s"] + result["t_compute_s"]]
    if result.get("t_cached_prefill_s"):
        names.append("cached-path prefill")
        vals.append(result["t_cached_prefill_s"])
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    ax.bar(range(len(vals)), [v * 1e3 for v in vals], color=["C0", "C1", "C7", "C3", "C8", "C2"][: len(vals)])
    ax.set_xticks(range(len(vals)), names, rotation=15, fontsize=8)
    ax.set(ylabel="ms", title=f"streamed prefill, {result['tokens']} tokens: "
                              f"T_prefill / max = {result['overlap_ratio']:.2f}")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
