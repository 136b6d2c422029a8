"""Regenerate docs/default_model.md (and docs/default_model_loss.png) from the shipped
default model: model card, validation perplexity against a unigram baseline, per-layer
expert load, routing locality, and sample generations.

    python scripts/default_model_report.py [--model ftjax/default_model] [--out docs/default_model.md]

Everything is measured on the exported folder (bf16 weights, f32 compute); the training
history comes from the "ftjax_training" metadata stored in its model.safetensors.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import ftjax  # noqa: E402
from ftjax import training  # noqa: E402
from ftjax.data import corpus  # noqa: E402
from ftjax.runinfo import git_commit  # noqa: E402

PROMPTS = {
    "shakespeare": "To be, or not to be",
    "austen": "It is a truth universally acknowledged",
    "kjv": "In the beginning God created",
}
SEQ_LEN = 256
WINDOWS_PER_CALL = 8


# ---- measurements ----------------------------------------------------------------------

def windows(ids: np.ndarray, seq_len: int = SEQ_LEN) -> np.ndarray:
    """Non-overlapping [n, T+1] windows (consecutive windows share their boundary token)."""
    n = (len(ids) - 1) // seq_len
    return np.stack([ids[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int32)


def model_pass(graphdef, params, wins: np.ndarray):
    """Teacher-forced NLL of every predicted token [n, T] and routing ids [Lm, n, T, K]."""
    fn = jax.jit(lambda p, t: training.route_ids(graphdef, p, t))
    nll, ids = [], []
    for i in range(0, len(wins), WINDOWS_PER_CALL):
        w = jnp.asarray(wins[i: i + WINDOWS_PER_CALL])
        logits, r = fn(params, w[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll.append(np.asarray(-jnp.take_along_axis(logp, w[:, 1:, None], axis=-1)[..., 0]))
        ids.append(np.asarray(r))
    return np.concatenate(nll), np.concatenate(ids, axis=1)


def unigram_nll(train_ids: np.ndarray, targets: np.ndarray, vocab: int) -> float:
    """Mean NLL of targets under an add-one smoothed unigram fit on train_ids."""
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[targets].mean())


def expert_load(ids: np.ndarray, num_experts: int) -> list[dict]:
    """Per layer: normalised entropy of the selection shares, min and max share. ids [Lm, ..., K]."""
    out = []
    for layer in ids:
        share = np.bincount(layer.ravel(), minlength=num_experts) / layer.size
        nz = share[share > 0]
        out.append({"entropy": float(-(nz * np.log(nz)).sum() / math.log(num_experts)),
                    "min": float(share.min()), "max": float(share.max())})
    return out


def reuse(prev: np.ndarray, cur: np.ndarray) -> np.ndarray:
    """Share of cur's K experts that prev also selected; prev/cur [..., K]."""
    return (cur[..., :, None] == prev[..., None, :]).any(-1).mean(-1)


def teacher_forced_locality(ids: np.ndarray) -> np.ndarray:
    """Per layer mean reuse between consecutive tokens of a window. ids [Lm, n, T, K] -> [Lm]."""
    return reuse(ids[:, :, :-1], ids[:, :, 1:]).mean(axis=(1, 2))


def decode_locality(model, tok, prompts: list[str], new_tokens: int) -> tuple[np.ndarray, int]:
    """Greedy decode with ftjax.load()'s expert_log -> per-layer reuse between consecutive
    decode steps (over all prompts), and the number of step pairs."""
    Lm = model.config.num_moe_layers
    total, pairs = np.zeros(Lm), 0
    for prompt in prompts:
        model.reset_stats()
        model.generate(tok.encode(prompt), new_tokens)
        steps: dict[int, dict[int, list[int]]] = {}
        for r in model.expert_log():
            if r["phase"] == "decode":
                steps.setdefault(r["step"], {})[r["layer"]] = r["selected"]
        order = sorted(steps)
        for a, b in zip(order, order[1:]):
            for layer in range(Lm):
                prev, cur = set(steps[a][layer]), steps[b][layer]
                total[layer] += sum(e in prev for e in cur) / len(cur)
            pairs += 1
    model.reset_stats()
    return total / max(pairs, 1), pairs


# ---- report -----------------------------------------------------------------------------------

def fmt_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def loss_curve(record: dict | None, rows: int = 12) -> tuple[list, list]:
    if not record:
        return [], []
    train = [r for r in record["log"] if "loss" in r]
    valid = [r for r in record["log"] if "valid" in r]
    picks = sorted({valid[int(i)]["step"] for i in np.linspace(0, len(valid) - 1, min(rows, len(valid)))}) if valid else []
    out = []
    for step in picks:
        near = [r for r in train if step - 50 < r["step"] <= step]  # mean of the logged steps just before
        v = next(r["valid"] for r in valid if r["step"] == step)
        out.append([step, f"{np.mean([r['ce'] for r in near]):.3f}" if near else "-",
                    f"{np.mean([r['aux'] for r in near]):.3f}" if near else "-",
                    *(f"{v[n]:.3f}" for n in v), f"{np.mean(list(v.values())):.3f}"])
    return out, list(valid[-1]["valid"]) if valid else []


def plot(record: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    train = [r for r in record["log"] if "loss" in r]
    valid = [r for r in record["log"] if "valid" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["ce"] for r in train], lw=0.8, alpha=0.7, label="train (cross-entropy)")
    for name in valid[0]["valid"] if valid else []:
        ax.plot([r["step"] for r in valid], [r["valid"][name] for r in valid], marker=".", label=f"valid {name}")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_ylim(top=min(8.5, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def train_flags(record: dict | None) -> str:
    """The non-default `train` flags of the recorded run."""
    if not record:
        return ""
    defaults = training.TrainSettings()
    flags = [f"--{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f"--{k.replace('_', '-')} {v}"
             for k, v in record["settings"].items() if getattr(defaults, k, None) != v]
    if record.get("max_minutes"):
        flags.append(f"--max-minutes {record['max_minutes']:g}")
    return " ".join(flags)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(training.DEFAULT_MODEL_DIR))
    ap.add_argument("--out", default=str(ROOT / "docs" / "default_model.md"))
    ap.add_argument("--decode-tokens", type=int, default=200)
    ap.add_argument("--max-windows", type=int, default=64, help="validation windows per text (each 256 tokens)")
    a = ap.parse_args()
    t0 = time.time()
    model_dir, out = Path(a.model), Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    model = ftjax.load(a.model)
    tok, cfg = model.tokenizer, model.config
    hf, graphdef, params = training.params_from_folder(model_dir)
    record = training.read_training_record(model_dir)
    E, K, V = cfg.num_experts, cfg.top_k, cfg.vocab_size
    file_bytes = (model_dir / "model.safetensors").stat().st_size
    total = training.num_params(params)
    expert_params = int(np.prod(params["experts"]["gate_up"].shape) + np.prod(params["experts"]["down"].shape))
    active = total - expert_params + expert_params * K // E

    # Perplexity, expert load and teacher-forced locality on each text's validation split.
    ppl_rows, all_ids, tf_rows = [], [], []
    for name in corpus.names():
        train_text, valid_text = corpus.split(name)
        train_ids = np.asarray(training.encode_long(tok, train_text))
        wins = windows(np.asarray(training.encode_long(tok, valid_text)))[: a.max_windows]
        nll, ids = model_pass(graphdef, params, wins)
        uni = unigram_nll(train_ids, wins[:, 1:].ravel(), V)
        ppl_rows.append([name, f"{nll.size:,}", f"{nll.mean():.3f}", f"{math.exp(nll.mean()):.1f}",
                         f"{math.exp(uni):.1f}", f"{math.exp(uni) / math.exp(nll.mean()):.1f}x"])
        all_ids.append(ids)
        tf_rows.append((name, teacher_forced_locality(ids)))
    ids = np.concatenate(all_ids, axis=1)  # [Lm, n, T, K]
    load = expert_load(ids, E)
    tf_all = teacher_forced_locality(ids)
    dec, pairs = decode_locality(model, tok, list(PROMPTS.values()), a.decode_tokens)

    samples = []
    for name, prompt in PROMPTS.items():
        p = tok.encode(prompt)
        greedy = tok.decode(model.generate(p, 80))
        sampled = tok.decode(model.generate(p, 80, temperature=0.8, top_p=0.9, seed=0))
        samples.append((name, prompt, greedy, sampled))
    chat = model.chat([{"role": "user", "content": "Continue this passage:\nTo be, or not to be"}], max_new_tokens=60)

    curve, valid_names = loss_curve(record)
    png = out.parent / "default_model_loss.png"
    have_png = bool(record) and plot(record, png)
    commit = git_commit() or "?"

    md = ["# The embedded default model (`ftjax/default_model/`)",
          "",
          f"Regenerated by `python scripts/default_model_report.py` (commit {commit}, "
          f"{time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s). A small Qwen3-MoE trained from scratch on this "
          "machine by `scripts/train_default_model.py` (`ftjax/training.py`) on three public-domain texts "
          "(Shakespeare, Jane Austen, the King James Bible; `ftjax.data.corpus`), shipped so that `ftjax.load()` "
          "works offline and the expert-cache experiments have a trained router.",
          "",
          "## Model card",
          "",
          fmt_table(["field", "value"], [
              ["architecture", f"`{hf['model_type']}` ({hf['architectures'][0]}), every layer MoE, tied embeddings"],
              ["vocab (V)", V], ["d_model (D)", cfg.d_model], ["layers (L)", cfg.num_layers],
              ["heads (H) / kv heads (G) / head_dim", f"{cfg.num_heads} / {cfg.num_kv_heads} / {cfg.head_dim}"],
              ["experts (E) / top-k (K) / expert FFN (F)", f"{E} / {K} / {cfg.d_ff_expert}"],
              ["norm_topk_prob / rope_theta / max positions", f"{cfg.norm_topk_prob} / {cfg.rope_theta:g} / {cfg.max_position}"],
              ["eos ids", ", ".join(f"{i} (`{tok.id_to_token(i)}`)" for i in cfg.eos_token_ids)],
              ["parameters", f"{total:,} ({expert_params:,} in routed experts)"],
              ["active per token", f"{active:,}"],
              ["model.safetensors", f"{file_bytes / 1e6:.2f} MB (bf16)"],
          ]),
          ""]
    if record:
        s = record["settings"]
        train_recs = [r for r in record["log"] if "loss" in r]
        last_valid = [r for r in record["log"] if "valid" in r][-1]["valid"]
        final_train = np.mean([r["ce"] for r in train_recs[-5:]])
        md += ["## Training", "",
               fmt_table(["field", "value"], [
                   ["steps", f"{record['step']:,} of a {s['steps']:,}-step schedule"],
                   ["tokens seen", f"{record['tokens']:,} (batch {s['batch_size']} x {s['seq_len']} tokens)"],
                   ["wall time", f"{record['elapsed_s'] / 60:.1f} min on a shared 2-core CPU (fp32)"],
                   ["optimizer", f"AdamW b=(0.9, 0.95), wd {s['weight_decay']}, peak lr {s['peak_lr']:g}, "
                                 f"warmup {s['warmup_steps']} + cosine to {s['min_lr_ratio']:g}x, clip {s['grad_clip']}"],
                   ["experts in training", f"`{s['expert_impl']}` (capacity factor {s['capacity_factor']})"],
                   ["load-balancing loss", f"coef {s['aux_loss_coef']} x E·Σ f_e·P_e (1.0 = uniform)"],
                   ["data", f"random {s['seq_len']}-token windows of the training splits; "
                            f"{s['chat_share']:.0%} of rows synthetic chat-template conversations; seed {s['seed']}"],
                   ["final train loss", f"{final_train:.3f} (cross-entropy, mean of the last 5 logged steps)"],
                   ["final valid loss", ", ".join(f"{n} {v:.3f}" for n, v in last_valid.items())],
               ]), "",
               "Loss curve (nats/token; train = mean of the logged steps in the 50 before; "
               "valid = 8 fixed windows per text):", "",
               fmt_table(["step", "train", "aux", *(f"valid {n}" for n in valid_names), "valid mean"], curve), ""]
        if have_png:
            md += [f"![loss curve]({png.name})", ""]
    md += ["## Validation perplexity", "",
           f"Each text's held-out tail (`ftjax.data.corpus.split`), non-overlapping {SEQ_LEN}-token windows "
           f"(at most {a.max_windows} per text), against an add-one smoothed unigram model fitted on the same "
           "text's training split with the same tokenizer.", "",
           fmt_table(["text", "tokens", "NLL", "perplexity", "unigram ppl", "gain"], ppl_rows), "",
           "## Expert load (validation text, teacher-forced)", "",
           f"Share of the top-{K} selections per expert; entropy normalised by log E (1.0 = perfectly even); "
           f"uniform share = {1 / E:.4f}.", "",
           fmt_table(["MoE layer", "entropy / log E", "min share", "max share"],
                     [[i, f"{r['entropy']:.3f}", f"{r['min']:.4f}", f"{r['max']:.4f}"] for i, r in enumerate(load)]), "",
           "## Routing locality", "",
           f"Share of a token's {K} experts that the previous token (same layer) also selected. "
           f"Uniform-random routing gives K/E = {K / E:.3f}. Teacher-forced: every consecutive pair of the "
           f"validation windows above; decode: greedy generation of {a.decode_tokens} tokens from each of the "
           f"{len(PROMPTS)} prompts below through `ftjax.load()`'s `expert_log()` ({pairs} step pairs).", "",
           fmt_table(["MoE layer", *(f"teacher-forced {n}" for n, _ in tf_rows), "teacher-forced all", "greedy decode",
                      "uniform K/E"],
                     [[i, *(f"{r[i]:.3f}" for _, r in tf_rows), f"{tf_all[i]:.3f}", f"{dec[i]:.3f}", f"{K / E:.3f}"]
                      for i in range(cfg.num_moe_layers)]
                     + [["mean", *(f"{r.mean():.3f}" for _, r in tf_rows), f"{tf_all.mean():.3f}", f"{dec.mean():.3f}",
                         f"{K / E:.3f}"]]), "",
           "## Samples", "",
           "80 new tokens after each prompt: greedy, then temperature 0.8 / top-p 0.9 (seed 0).", ""]
    for name, prompt, greedy, sampled in samples:
        md += [f"**{name}** — `{prompt}`", "", "Greedy:", "", "```text", prompt + greedy, "```", "",
               "Sampled:", "", "```text", prompt + sampled, "```", ""]
    md += ["Chat (`model.chat`, greedy, 60 tokens) for *\"Continue this passage: To be, or not to be\"*:", "",
           "```text", chat, "```", "",
           "## Reproduce", "",
           "```bash",
           "export OPENBLAS_NUM_THREADS=1",
           f"python scripts/train_default_model.py train {train_flags(record)}            # -> runs/default_model/",
           f"python scripts/train_default_model.py train {train_flags(record)} --resume   # continue after a stop",
           "python scripts/train_default_model.py export   # -> ftjax/default_model/model.safetensors + config",
           "python scripts/default_model_report.py         # -> docs/default_model.md",
           "```", ""]
    if record and record.get("replans"):
        md += ["The schedule length was re-planned during the run (`--resume` with a new `--steps`, because the "
               "shared machine ran slower than planned): " + "; ".join(
                   f"at step {r['step']}: {r['from']} -> {r['to']} steps" for r in record["replans"])
               + ". The bit-exact recipe is therefore: train with the first `--steps`, stop after a checkpoint at "
               "that step, then `--resume` with the new one; one uninterrupted run with the final `--steps` "
               "gives a very similar model (the learning rate differs by a few percent before the re-plan).", ""]
    out.write_text("\n".join(md))
    print(f"wrote {out}" + (f" and {png}" if have_png else "") + f" in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
