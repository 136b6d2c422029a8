"""`ftjax` command line: generate | chat | profile | bench.

    ftjax generate [--model DIR] "prompt"     stream a continuation (default: embedded model)
    ftjax chat [--model DIR] "message"        one chat turn through the chat template
    ftjax profile [--json] [--threads N]      measure B_P / B_H, save the profile
    ftjax bench paper --out DIR [--quick]     regenerate the paper's experiments

Text goes to stdout as it is produced; a summary line (prompt tokens, TTFT, decode
tok/s, expert-cache counters) goes to stderr, or one JSON line to stdout with --json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: the embedded model)")
    p.add_argument("--policy", default="device", help="expert placement policy (device, host, lru, ...)")
    p.add_argument("--cache-slots", type=int, default=None, help="device expert-cache slots")
    p.add_argument("--cache-bytes", type=float, default=None, help="device expert-cache size in bytes")
    p.add_argument("--bandwidth", type=float, nargs=2, metavar=("B_P", "B_H"), default=None,
                   help="override the measured bandwidths (GB/s)")
    p.add_argument("--threads", type=int, default=None, help="host expert-kernel threads")
    p.add_argument("--max-seq-len", type=int, default=None)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", "-n", type=int, default=128)
    p.add_argument("--temperature", "-t", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of streaming text")


def _load(args):
    import ftjax

    t0 = time.perf_counter()
    model = ftjax.load(args.model, policy=args.policy, cache_slots=args.cache_slots,
                       cache_bytes=args.cache_bytes, threads=args.threads, max_seq_len=args.max_seq_len,
                       bandwidth=tuple(args.bandwidth) if args.bandwidth else None)
    if model.tokenizer is None:
        raise SystemExit(f"error: {args.model} has no tokenizer.json; ftjax generate needs text in and out")
    return model, time.perf_counter() - t0


def _run(model, ids, args, load_s: float) -> int:
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop)
    decoder = model.tokenizer.stream_decoder()
    pieces = []
    for tok in model.generate_stream(ids, args.max_new_tokens, **sampling):
        piece = decoder.push(tok)
        pieces.append(piece)
        if not args.json and piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
    tail = decoder.flush()
    pieces.append(tail)
    g = model.last_generation
    stats = model.stats()
    summary = {
        "prompt_tokens": g.prompt_tokens, "new_tokens": g.new_tokens, "ttft_s": round(g.ttft_s, 4),
        "decode_tok_per_s": round(g.decode_tok_per_s, 2), "stop_reason": g.stop_reason, "load_s": round(load_s, 3),
        "policy": stats["policy"], "hits": stats["hits"], "misses": stats["misses"],
        "fetched": stats["fetched"], "host_computed": stats["host_computed"],
    }
    if args.json:
        print(json.dumps({"text": "".join(pieces), **summary}))
    else:
        sys.stdout.write(tail + "\n")
        print(f"[{g.prompt_tokens} prompt tokens, TTFT {g.ttft_s * 1e3:.0f} ms, {g.new_tokens} new tokens, "
              f"{g.decode_tok_per_s:.1f} tok/s decode, stop: {g.stop_reason}; policy {stats['policy']}: "
              f"{stats['hits']} hits / {stats['misses']} misses]", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    model, load_s = _load(args)
    return _run(model, model.tokenizer.encode(args.prompt), args, load_s)


def cmd_chat(args) -> int:
    model, load_s = _load(args)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.message}]
    return _run(model, model.tokenizer.encode_chat(messages), args, load_s)


def cmd_profile(argv: list[str]) -> int:
    from ftjax.experts.profile import main_profile

    return main_profile(argv) or 0


def cmd_bench(argv: list[str]) -> int:
    from ftjax.bench import main_bench

    return main_bench(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # profile and bench own their flags
    if argv and argv[0] == "profile":
        return cmd_profile(argv[1:])
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    parser = argparse.ArgumentParser(prog="ftjax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="continue a prompt")
    g.add_argument("prompt")
    _add_runtime_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="one chat turn through the model's chat template")
    c.add_argument("message")
    c.add_argument("--system", default=None)
    _add_runtime_args(c)
    _add_sampling_args(c)
    c.set_defaults(func=cmd_chat)
    sub.add_parser("profile", help="measure B_P and B_H (see `ftjax profile --help`)")
    sub.add_parser("bench", help="benchmarks and the paper's experiments (see `ftjax bench --help`)")
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
