"""Train, resume and export the embedded default model (thin CLI over `ftjax.training`).

    python scripts/train_default_model.py train  --steps 1900 --max-minutes 78
    python scripts/train_default_model.py train  --steps 1900 --max-minutes 78 --resume
    python scripts/train_default_model.py export                  # -> ftjax/default_model/
    python scripts/train_default_model.py train --tiny --steps 20  # smoke test, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ftjax import training  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--run-dir", default=str(ROOT / "runs" / "default_model"))
    t.add_argument("--resume", action="store_true", help="continue from the run's checkpoint")
    t.add_argument("--max-minutes", type=float, default=None, help="stop (and checkpoint) after this much wall time")
    t.add_argument("--tiny", action="store_true", help="the tiny test config instead of the default model")
    for f in dataclasses.fields(training.TrainSettings):
        t.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    e = sub.add_parser("export")
    e.add_argument("--run-dir", default=str(ROOT / "runs" / "default_model"))
    e.add_argument("--out", default=str(training.DEFAULT_MODEL_DIR))
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = ap.parse_args()

    if a.cmd == "train":
        from ftjax.tokenizer import Tokenizer

        s = training.TrainSettings(**{f.name: getattr(a, f.name) for f in dataclasses.fields(training.TrainSettings)})
        hf = training.tiny_hf_config() if a.tiny else training.hf_config(aux_loss_coef=s.aux_loss_coef)
        corpus = training.Corpus(Tokenizer.from_dir(training.DEFAULT_MODEL_DIR))
        print(f"train tokens {len(corpus.train):,}; valid " + ", ".join(f"{n} {len(v):,}" for n, v in corpus.valid.items()),
              flush=True)
        _, meta = training.train(a.run_dir, hf, s, corpus, resume=a.resume, max_minutes=a.max_minutes,
                                 log=lambda m: print(m, flush=True))
        print(f"done: step {meta['step']}, {meta['tokens']:,} tokens, {meta['elapsed_s'] / 60:.1f} min", flush=True)
    else:
        hf, params, meta = training.load_params(a.run_dir)
        out = training.export(hf, params, a.out, a.dtype, training_record=training.training_record(a.run_dir, meta))
        print(f"exported step {meta['step']} to {out}")


if __name__ == "__main__":
    main()
