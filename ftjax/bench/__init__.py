"""`ftjax bench ...`: benchmarks that regenerate the paper's experiments.

    ftjax bench paper --out DIR [--quick] [--model DIR] [--threads N]

Modules: traces (routing traces of real runs), cachelab (miss-rate curves, the LRU
check against the runtime), qsweep (bandwidth split, predicted and measured), decode
(simulated decode per machine, simulator vs measured), prefill (streamed prefill
overlap), report (report.md, claims, summary), paper (the stages, in order).
Progress goes to stderr; the last stdout line is one JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftjax bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    paper = sub.add_parser("paper", help="the FreeToken paper's experiments into one folder")
    paper.add_argument("--out", required=True, help="output folder (created)")
    paper.add_argument("--quick", action="store_true", help="a few minutes: fewer tokens, prompts and repeats")
    paper.add_argument("--model", default=None, help="Hugging Face MoE folder with tokenizer (default: embedded model)")
    paper.add_argument("--threads", type=int, default=None, help="host expert-kernel threads (default: all cores)")
    paper.add_argument("--texts", nargs="+", default=None, help="held-out corpus texts to trace (default: all)")
    paper.add_argument("--no-reference-shape", action="store_true",
                       help="skip the q sweep and profile with Qwen3-30B-A3B-shaped experts")
    return p


def main_bench(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from ftjax.bench.paper import PaperSettings, run_paper

    kw = {"threads": args.threads}
    if args.texts:
        kw["texts"] = tuple(args.texts)
    if args.no_reference_shape:
        kw["reference_shape"] = False
    settings = PaperSettings.quick(**kw) if args.quick else PaperSettings.full(**kw)
    summary = run_paper(args.out, args.model, settings, quick=args.quick)
    print(json.dumps(summary, separators=(",", ":"), default=str), flush=True)
    return 1 if summary.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main_bench())
