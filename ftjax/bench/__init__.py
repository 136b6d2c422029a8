"""`ftjax bench ...`: benchmarks that regenerate the paper's experiments.

    ftjax bench paper --out DIR [--quick] [--model DIR] [--threads N] [--allow-dirty]
    ftjax bench agent --out DIR [--quick] [--model DIR] [--modes off prefix semantic] [--allow-dirty]

Modules: traces (routing traces of real runs), cachelab (miss-rate curves, the LRU
check against the runtime), qsweep (bandwidth split, predicted and measured), decode
(simulated decode per machine, simulator vs measured), prefill (streamed prefill
overlap), report (report.md, claims, summary), paper (the stages, in order);
agent (agent transcripts replayed against `ftjax serve`: tail TTFT per state-cache mode).
Progress goes to stderr; the last stdout line is one JSON summary, with the commit and
whether the tree was dirty. Both refuse to start on a tree with uncommitted changes to
tracked files unless given --allow-dirty (`ftjax.runinfo.require_clean`): results worth
keeping are the ones a commit reproduces.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from ftjax.runinfo import DirtyTreeError, add_allow_dirty_argument, require_clean


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
    add_allow_dirty_argument(paper)
    _add_agent_parser(sub)
    return p


def _add_agent_parser(sub) -> None:
    from ftjax.bench.agent import MODES
    from ftjax.data.agent_transcripts import all_names, names

    a = sub.add_parser("agent", help="replay agent transcripts against ftjax serve: TTFT p50/p95/max per "
                                     "state-cache mode")
    a.add_argument("--out", required=True, help="output folder (created)")
    a.add_argument("--model", default=None, help="model folder for serve (default: embedded model)")
    a.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="server --state-cache modes")
    a.add_argument("--workloads", nargs="+", choices=all_names(), default=names(),
                   help="transcripts to replay (coding-loop: a long session, for a longer --max-seq-len)")
    a.add_argument("--turns", type=int, default=None, help="replay at most N requests per workload")
    a.add_argument("--scale", type=float, default=None,
                   help="transcript size multiplier (default 1: fits the embedded model's 2048-token context)")
    a.add_argument("--quick", action="store_true", help="3 requests per workload, scale 0.5, max_tokens 8")
    a.add_argument("--port", type=int, default=0, help="server port (default 0: a free one per mode)")
    a.add_argument("--timeout-s", type=float, default=300.0, help="server start-up and per-request timeout")
    a.add_argument("--max-tokens", type=int, default=None, help="tokens generated per request (default 16)")
    a.add_argument("--no-warmup", action="store_true", help="start serve without --warmup (compiles during replay)")
    a.add_argument("--device-memory-gb", type=float, default=None,
                   help="serve's device memory budget (GiB); /v1/stats then reports the memory split plotted")
    a.add_argument("--history", default="rewritten", metavar="{rewritten,append,keep-last-K}",
                   help="send the transcripts with the history rewrites agent frameworks do, append-only, or "
                        "with every tool output but the last K replaced by a placeholder")
    a.add_argument("--tool-time-s", type=float, default=0.0,
                   help="seconds the agent's tool runs between a response and the next request (idle engine)")
    a.add_argument("--agents", type=int, default=1,
                   help="concurrent sessions per workload (default 1: one request at a time); with more "
                        "sessions than --max-batch and no tool time every row stays busy")
    a.add_argument("--max-batch", type=int, default=1, help="serve --max-batch: rows decoding at once (default 1)")
    a.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="pass ARG to serve as it is (repeatable; e.g. --serve-arg=--policy --serve-arg=host)")
    add_allow_dirty_argument(a)


def _main_agent(args) -> int:
    from ftjax.bench.agent import AgentSettings, run_agent

    bad = [f"--{n.replace('_', '-')} must be at least 1, got {getattr(args, n)}" for n in ("turns", "max_tokens", "agents", "max_batch")
           if getattr(args, n) is not None and getattr(args, n) < 1]
    if args.scale is not None and not args.scale > 0:
        bad.append(f"--scale must be positive, got {args.scale}")
    if not (args.tool_time_s >= 0):
        bad.append(f"--tool-time-s must be >= 0, got {args.tool_time_s}")
    if not re.fullmatch(r"rewritten|append|keep-last-[1-9]\d*", args.history):
        bad.append(f"--history must be rewritten, append or keep-last-K (K >= 1), got {args.history!r}")
    if bad:
        print(f"ftjax bench agent: error: {bad[0]}", file=sys.stderr)
        return 2
    kw = {k: v for k, v in (("turns", args.turns), ("scale", args.scale), ("max_tokens", args.max_tokens))
          if v is not None}
    kw.update(modes=tuple(dict.fromkeys(args.modes)), workloads=tuple(dict.fromkeys(args.workloads)),
              model=args.model, port=args.port, timeout_s=args.timeout_s, warmup=not args.no_warmup,
              device_memory_gb=args.device_memory_gb, serve_args=tuple(args.serve_arg), history=args.history,
              tool_time_s=args.tool_time_s, agents=args.agents, max_batch=args.max_batch)
    settings = AgentSettings.quick(**kw) if args.quick else AgentSettings(**kw)
    summary = run_agent(args.out, settings)
    print(json.dumps(summary, separators=(",", ":"), default=str), flush=True)
    return 1 if summary["errors"] or "ok" not in summary["modes"].values() else 0


def main_bench(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        require_clean(args.allow_dirty)
    except DirtyTreeError as e:
        print(f"ftjax bench {args.command}: error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if args.command == "agent":
        return _main_agent(args)
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
