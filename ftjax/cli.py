"""`ftjax` command line: generate | chat | serve | profile | bench.

    ftjax generate [--model DIR] "prompt"     stream a continuation (default: embedded model)
    ftjax generate - < prompt.txt             the prompt from stdin
    ftjax chat [--model DIR] "message"        one chat turn through the chat template
    ftjax chat [--model DIR]                  interactive: one user message per stdin line
    ftjax serve [--model DIR] [--port 8000]   OpenAI- and Anthropic-compatible HTTP server
    ftjax profile [--json] [--threads N]      measure B_P / B_H, save the profile
    ftjax bench paper --out DIR [--quick]     regenerate the paper's experiments
    ftjax bench agent --out DIR               agent transcripts against `ftjax serve`: tail TTFT
    ftjax --version

Text goes to stdout as it is produced; a summary line (prompt tokens, TTFT, steady decode
tok/s with the first decode step — where compilation happens — reported apart,
expert-cache counters) goes to stderr, or one JSON line to stdout with --json.
Ctrl-C stops cleanly (exit status 130); bad options exit with status 2.

Compiled programs persist across runs in XLA's compilation cache (`ftjax.compilation`):
a second run or a restarted server loads its prefill and decode steps instead of
compiling them. FTJAX_COMPILE_CACHE sets the directory (default
$XDG_CACHE_HOME/ftjax/xla or ~/.cache/ftjax/xla; "0" turns it off).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

EXIT_USAGE, EXIT_DISTRIBUTED, EXIT_INTERRUPTED = 2, 3, 130


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the description's layout and show every option's default."""


def version() -> str:
    try:
        from importlib.metadata import version as dist_version

        return dist_version("ftjax")
    except Exception:  # not installed as a distribution (a bare checkout on sys.path)
        return "unknown"


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    from ftjax.experts.policy import POLICIES

    cached = [n for n, pol in POLICIES.items() if pol.uses_slots]
    p.add_argument("--model", default=None, metavar="DIR",
                   help="Hugging Face model folder (default None: the embedded model)")
    p.add_argument("--policy", default="device", choices=list(POLICIES), metavar="POLICY",
                   help="expert placement policy: " + ", ".join(POLICIES) + f" ({', '.join(cached)} need "
                        "--cache-slots or --cache-bytes)")
    p.add_argument("--cache-slots", type=int, default=None,
                   help="device expert-cache slots (policies with a cache only)")
    p.add_argument("--cache-bytes", type=float, default=None,
                   help="device expert-cache size in bytes, instead of --cache-slots")
    p.add_argument("--bandwidth", type=float, nargs=2, metavar=("B_P", "B_H"), default=None,
                   help="override the measured host->device and host-kernel bandwidths, GB/s (policy lru)")
    p.add_argument("--threads", type=int, default=None,
                   help="host expert-kernel threads (default None: every core this process may use)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="context length to allocate (default None: the model's maximum)")
    p.add_argument("--numerics", choices=["auto", "exact", "fast"], default="auto",
                   help="exact: f32 K/V cache; fast: bf16 K/V, as llama.cpp (half the bytes a long-context decode "
                        "reads); auto: fast for bf16 / fp16 / quantised weights, exact for f32 ones")
    p.add_argument("--device-memory-gb", type=float, default=None,
                   help="one device-memory budget (GiB) for weights, states, prefill scratch and the expert cache, "
                        "whose buffer is re-allocated smaller (its bytes given back) as states grow "
                        "(default None: no budget)")
    p.add_argument("--devices", type=int, default=None,
                   help="split the experts over this many devices (a mesh; attention replicated); on the CPU "
                        "backend, as many forced devices: XLA_FLAGS=--xla_force_host_platform_device_count=N "
                        "(default: one device)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="run as one of several processes (jax.distributed): process 0 listens here, every "
                        "process gives the same address; the experts are split over every process's devices")
    p.add_argument("--num-processes", type=int, default=None, help="with --coordinator: how many processes")
    p.add_argument("--process-id", type=int, default=None, help="with --coordinator: this process (0..N-1)")
    p.add_argument("--join-timeout-s", type=float, default=60.0,
                   help="with --coordinator: how long to wait for every process to join, and for a lost one "
                        "to be named")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", "-n", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", "-t", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy (the most likely token)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: the smallest set of tokens with this much probability; 1 = all")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of streaming text")


class UsageError(ValueError):
    """A bad option value, reported as `error: ...` with exit status 2."""


def check_args(args) -> None:
    """Reject values the model would silently accept or fail on later, naming the option."""
    from ftjax.experts.policy import POLICIES
    from ftjax.host import default_threads

    pol = POLICIES[args.policy]
    for name in ("cache_slots", "cache_bytes"):
        value = getattr(args, name)
        opt = "--" + name.replace("_", "-")
        if value is None:
            continue
        finite(opt, value)
        if not pol.uses_slots:
            cached = ", ".join(n for n, p in POLICIES.items() if p.uses_slots)
            raise UsageError(f"{opt}: policy {args.policy!r} has no expert cache; use one of {cached}")
        if value <= 0:
            raise UsageError(f"{opt} must be positive, got {value:g}")
    if args.cache_slots is not None and args.cache_bytes is not None:
        raise UsageError("give --cache-slots or --cache-bytes, not both")
    if args.threads is not None:
        cores = default_threads()
        if not 1 <= args.threads <= 4 * cores:
            raise UsageError(f"--threads must be in 1..{4 * cores} (4x the {cores} usable cores), got {args.threads}")
    if args.bandwidth is not None:
        for name, value in zip(("B_P", "B_H"), args.bandwidth):
            finite(f"--bandwidth {name}", value)
            if value <= 0:
                raise UsageError(f"--bandwidth {name} must be positive, got {value:g}")
    if args.max_seq_len is not None and args.max_seq_len <= 0:
        raise UsageError(f"--max-seq-len must be positive, got {args.max_seq_len}")
    if args.device_memory_gb is not None:
        finite("--device-memory-gb", args.device_memory_gb)
        if args.device_memory_gb <= 0:
            raise UsageError(f"--device-memory-gb must be positive, got {args.device_memory_gb:g}")
    if args.devices is not None and args.devices < 1:
        raise UsageError(f"--devices must be >= 1, got {args.devices}")
    if args.coordinator is not None:
        if args.num_processes is None or args.process_id is None:
            raise UsageError("--coordinator needs --num-processes and --process-id")
        if args.devices is not None:
            raise UsageError("--devices: with --coordinator the experts are split over every process's devices")
        if args.command == "serve" and args.state_cache_dir is not None:
            raise UsageError("--state-cache-dir: not with --coordinator (every process would persist the same "
                             "states; the device and host tiers work)")
    elif args.num_processes is not None or args.process_id is not None:
        raise UsageError("--num-processes / --process-id need --coordinator")
    if args.command == "serve":
        return check_serve_args(args)
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    finite("--temperature", args.temperature)
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature:g}")
    finite("--top-p", args.top_p)
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p:g}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = all tokens), got {args.top_k}")


def _load(args):
    import ftjax

    t0 = time.perf_counter()
    devices = args.devices
    if args.coordinator is not None:
        import jax

        from ftjax import distributed

        distributed.connect(args.coordinator, args.num_processes, args.process_id, args.join_timeout_s)
        devices = jax.device_count()
        if args.process_id != 0:  # every process computes; process 0 speaks
            sys.stdout = open(os.devnull, "w")
    model = ftjax.load(args.model, policy=args.policy, cache_slots=args.cache_slots, devices=devices,
                       cache_bytes=args.cache_bytes, threads=args.threads, max_seq_len=args.max_seq_len,
                       numerics=args.numerics, bandwidth=tuple(args.bandwidth) if args.bandwidth else None,
                       device_memory_bytes=int(args.device_memory_gb * 2**30) if args.device_memory_gb else None)
    if model.tokenizer is None:
        raise UsageError(f"{args.model} has no tokenizer.json; ftjax {args.command} needs text in and out")
    return model, time.perf_counter() - t0


def _cache_split(stats: dict) -> str:
    """`hits / misses`, and where the misses went for policies that can miss."""
    text = f"{stats['hits']} hits / {stats['misses']} misses"
    if stats["policy"] != "device":
        parts = [f"{stats['fetched']} fetched", f"{stats['host_computed']} on host"]
        if stats.get("streamed"):
            parts.append(f"{stats['streamed']} streamed")
        text += f" ({', '.join(parts)})"
    return text


def _generate(model, ids, args, load_s: float) -> str:
    """Stream one generation to stdout (or print its JSON line); returns the text."""
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop)
    decoder = model.tokenizer.stream_decoder()
    pieces = []
    model.reset_stats()  # the counters of this generation only
    try:
        for tok in model.generate_stream(ids, args.max_new_tokens, **sampling):
            piece = decoder.push(tok)
            pieces.append(piece)
            if not args.json and piece:
                sys.stdout.write(piece)
                sys.stdout.flush()
    finally:
        tail = decoder.flush()
        pieces.append(tail)
        if not args.json:
            sys.stdout.write(tail + "\n")
            sys.stdout.flush()
    g = model.last_generation
    stats = model.stats()
    summary = {
        "prompt_tokens": g.prompt_tokens, "new_tokens": g.new_tokens, "ttft_s": round(g.ttft_s, 4),
        "decode_tok_per_s": round(g.decode_tok_per_s, 2), "first_step_s": round(g.first_step_s, 4),
        "reshape_steps": g.reshape_steps, "reshape_s": round(g.reshape_s, 4),
        "stop_reason": g.stop_reason, "load_s": round(load_s, 3),
        "policy": stats["policy"], "hits": stats["hits"], "misses": stats["misses"],
        "fetched": stats["fetched"], "host_computed": stats["host_computed"], "streamed": stats.get("streamed", 0),
    }
    text = "".join(pieces)
    if args.json:
        print(json.dumps({"text": text, **summary}), flush=True)
    else:
        print(f"[{g.prompt_tokens} prompt tokens, TTFT {g.ttft_s * 1e3:.0f} ms, {g.new_tokens} new tokens, "
              f"{g.decode_tok_per_s:.1f} tok/s decode (steady; first step {g.first_step_s * 1e3:.0f} ms"
              + (f", {g.reshape_steps} step(s) at a larger state {g.reshape_s * 1e3:.0f} ms" if g.reshape_steps else "")
              + f": compile included on first use), stop: {g.stop_reason}; policy {stats['policy']}: "
              f"{_cache_split(stats)}]", file=sys.stderr, flush=True)
    return text


def _text_arg(value: str) -> str:
    """The argument, or all of stdin for `-`."""
    return sys.stdin.read() if value == "-" else value


def cmd_generate(args) -> int:
    prompt = _text_arg(args.prompt)
    model, load_s = _load(args)
    _generate(model, model.tokenizer.encode(prompt), args, load_s)
    return 0


def _chat_ids(model, messages: list[dict]) -> list[int]:
    return model.tokenizer.encode(model.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def cmd_chat(args) -> int:
    system = [{"role": "system", "content": args.system}] if args.system else []
    if args.message is not None:  # one turn
        message = _text_arg(args.message)
        model, load_s = _load(args)
        _generate(model, _chat_ids(model, system + [{"role": "user", "content": message}]), args, load_s)
        return 0
    # Interactive: every stdin line is a user message; the history is kept until EOF.
    model, load_s = _load(args)
    interactive = sys.stdin.isatty()
    if interactive:
        print("ftjax chat: one message per line; Ctrl-D ends, Ctrl-C stops.", file=sys.stderr)
    messages = list(system)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = _generate(model, _chat_ids(model, messages), args, load_s)
        messages.append({"role": "assistant", "content": reply})
        load_s = 0.0  # only the first turn paid for loading
    return 0


def finite(name: str, value) -> None:
    if value is not None and not math.isfinite(value):
        raise UsageError(f"{name} must be a finite number, got {value}")


def check_serve_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    for name in ("max_batch", "prefill_chunk", "max_body_bytes", "max_queue"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("state_cache_device_gb", "state_cache_host_gb", "state_cache_disk_gb"):
        finite(f"--{name.replace('_', '-')}", getattr(args, name))
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name):g}")
    for name in ("keepalive_s", "request_timeout_s", "drain_s"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")


def cmd_serve(args) -> int:
    from pathlib import Path

    from ftjax.engine.state_cache import StateCache
    from ftjax.serve import serve

    model, _ = _load(args)
    model_id = args.served_model_name or (Path(args.model).name if args.model else "ftjax-default")
    cache = None if args.state_cache == "off" else StateCache(
        model, args.state_cache, int(args.state_cache_device_gb * 2**30), int(args.state_cache_host_gb * 2**30),
        args.state_cache_dir, int(args.state_cache_disk_gb * 2**30))
    serve(model, args.host, args.port, model_id, args.max_batch, args.prefill_chunk, args.max_body_bytes,
          args.keepalive_s, args.warmup, cache, args.max_queue, args.request_timeout_s, args.drain_s,
          args.idle_reprefill == "on")
    return 0


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default None: the folder name, or ftjax-default)")
    p.add_argument("--max-batch", type=int, default=4, help="requests decoded together in one batched step")
    p.add_argument("--prefill-chunk", type=int, default=512,  # scheduler.DEFAULT_PREFILL_CHUNK (not imported: jax)
                   help="prompt tokens prefilled between two decode steps of the running requests (larger: "
                        "a new prompt's first token sooner, the running requests' next tokens later)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    p.add_argument("--max-queue", type=int, default=64,  # scheduler.DEFAULT_MAX_QUEUE
                   help="requests waiting for a batch row; more get 429 (OpenAI) / 529 (Anthropic) with Retry-After")
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="the longest a request may take, queue included (a client may ask for less with the "
                        "X-Request-Timeout header); past it the request ends with a 504")
    p.add_argument("--drain-s", type=float, default=30.0,
                   help="on SIGTERM / Ctrl-C: seconds queued and running requests get to finish before they are "
                        "ended with an error and the server exits")
    p.add_argument("--keepalive-s", type=float, default=5.0,
                   help="seconds between keepalives (SSE comments / Anthropic pings) while a stream waits")
    p.add_argument("--warmup", action="store_true",
                   help="compile the engine's programs (every batch and capacity bucket) before listening")
    p.add_argument("--state-cache", default="prefix", choices=["off", "prefix", "semantic"],
                   help="reuse conversation states across requests: snapshots at the end of each prompt (prefix), "
                        "and also after </think>, </tool_call>, </tool_output> (semantic; on attention-only models "
                        "the two are the same). prefix is the default: it had the lower p95 TTFT in the agent "
                        "bench (docs/results.md)")
    p.add_argument("--state-cache-device-gb", type=float, default=1.0, help="state cache: device tier budget (GiB)")
    p.add_argument("--state-cache-host-gb", type=float, default=4.0, help="state cache: host-RAM tier budget (GiB)")
    p.add_argument("--state-cache-dir", default=None,
                   help="state cache: disk tier folder (orbax); a restarted server resumes the sessions kept there")
    p.add_argument("--state-cache-disk-gb", type=float, default=32.0, help="state cache: disk tier budget (GiB)")
    p.add_argument("--idle-reprefill", choices=["on", "off"], default="on",
                   help="learn how each conversation rewrites its history and prefill the predicted next one into "
                        "the state cache while the engine is idle (a request preempts it; reuse needs an exact "
                        "token match, so a wrong prediction costs idle compute only; needs a state cache)")


def cmd_profile(argv: list[str]) -> int:
    from ftjax.experts.profile import main_profile

    return main_profile(argv) or 0


def cmd_bench(argv: list[str]) -> int:
    from ftjax.bench import main_bench

    return main_bench(argv) or 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftjax", description=__doc__, formatter_class=_Formatter)
    p.add_argument("--version", action="version", version=f"ftjax {version()}")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="continue a prompt", formatter_class=_Formatter,
                       description="Stream a continuation of PROMPT to stdout, a summary to stderr.")
    g.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    _add_runtime_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="chat through the model's chat template", formatter_class=_Formatter,
                       description="One chat turn for MESSAGE; without MESSAGE, an interactive chat that reads "
                                   "one user message per stdin line until EOF and keeps the history.")
    c.add_argument("message", nargs="?", default=None,
                   help="the user message, - to read it from stdin; omit for an interactive chat")
    c.add_argument("--system", default=None, help="system prompt")
    _add_runtime_args(c)
    _add_sampling_args(c)
    c.set_defaults(func=cmd_chat)
    v = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server", formatter_class=_Formatter,
                       description="Serve the model over HTTP: OpenAI /v1/chat/completions, /v1/completions, "
                                   "/v1/models; Anthropic /v1/messages, /v1/messages/count_tokens; /health, /v1/stats.")
    _add_runtime_args(v)
    _add_serve_args(v)
    v.set_defaults(func=cmd_serve)
    sub.add_parser("profile", help="measure B_P and B_H (see `ftjax profile --help`)", add_help=False)
    sub.add_parser("bench", help="benchmarks and the paper's experiments (see `ftjax bench --help`)",
                   add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from ftjax import distributed
    from ftjax.compilation import enable_persistent_cache
    from ftjax.distributed import DistributedError

    enable_persistent_cache()
    try:
        # profile and bench own their flags
        if argv and argv[0] == "profile":
            return cmd_profile(argv[1:])
        if argv and argv[0] == "bench":
            return cmd_bench(argv[1:])
        args = parser().parse_args(argv)
        try:
            check_args(args)
            return args.func(args)
        except DistributedError as e:  # a peer that is gone or never came: name it, end without waiting on it
            print(f"error: {e}", file=sys.stderr)
            distributed.exit(EXIT_DISTRIBUTED)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\ninterrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
