"""llama.cpp (through llama-cpp-python) on the same checkpoint: decode and prompt-eval speed.

Benchmark-only dependency, NOT a dependency of ftjax. Build it from source for this CPU
(a separate venv that sees the system packages keeps it out of the main environment):

    python -m venv --system-site-packages /tmp/llvenv
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \\
        /tmp/llvenv/bin/pip install llama-cpp-python==0.3.36 --no-binary llama-cpp-python

On a CPU with AMX, a native build (`-DGGML_NATIVE=ON`) dies with SIGILL on Q8_0 / Q4_K
GGUFs: its AMX repack kernel (`tinygemm_kernel_amx`) runs `tileloadd` in a thread where
the tiles are not usable (seen under gdb on a 2-core Xeon VM). llama.cpp's own
`llama-bench --repack 0` (built from the same vendored sources: `cmake -S
vendor/llama.cpp -B build && cmake --build build --target llama-bench`) runs its
AVX-512 path on those files: `--llama-bench BIN` runs it (pp of --prompt tokens and tg of
--new tokens from an empty context, --rounds repetitions, `-o jsonl`) and writes one
`decode_llamacpp` line per round, as the binding's mode does:

    OPENBLAS_NUM_THREADS=1 python scripts/bench_llamacpp.py --llama-bench /tmp/llbench/bin/llama-bench \
        --gguf /tmp/olmoe4-q4_k_m.gguf --threads 2 --prompt 512 --new 32 --rounds 3

Conversion (`--convert`): the sdist's own `vendor/llama.cpp/convert_hf_to_gguf.py`
(with its vendored gguf-py) writes a bf16 GGUF. The geometry checkpoint has no
tokenizer, so `Qwen3MoeModel.set_vocab` is replaced by the converter's own "none"
vocabulary (`tokenizer.ggml.model = none` + `qwen3moe.vocab_size`), for which llama.cpp
creates dummy tokens; the benchmark feeds token ids, so no tokenizer is needed.

    /tmp/llvenv/bin/python scripts/bench_llamacpp.py --convert /tmp/ftjax-geom \\
        --llama-src /tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp --gguf /tmp/ftjax-geom-bf16.gguf
    OPENBLAS_NUM_THREADS=1 nice -n 5 /tmp/llvenv/bin/python scripts/bench_llamacpp.py \\
        --gguf /tmp/ftjax-geom-bf16.gguf --threads 1
    /tmp/llvenv/bin/python scripts/bench_llamacpp.py --gguf /tmp/olmoe-attn-bf16.gguf \\
        --contexts 1024 2048 4096 8192 16384 32768 --new 8 --threads 2      # long context
    python scripts/bench_llamacpp.py --llama-bench /tmp/llbench/bin/llama-bench --gguf /tmp/olmoe-attn-bf16.gguf \\
        --contexts 8 3000 32768 --new 16 --rounds 3 --threads 2    # long context, llama-bench's tg at depth

Measurement (same as scripts/bench_decode.py): process pinned to the first N cores,
n_threads = n_threads_batch = N; prompt of --prompt ids drawn as bench_decode draws them
(RandomState(0), vocab 151936), one full warm-up generation, then `eval(prompt)` timed
(prompt eval) and --new greedy tokens (argmax of the last logits, one `eval([tok])` per
token) timed token by token; medians. llama.cpp's own perf counters are reported too.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

if __name__ == "__main__" and "--threads" in sys.argv:
    n = int(sys.argv[sys.argv.index("--threads") + 1])
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:n]))

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _runinfo():
    """ftjax/runinfo.py by path: this script runs in llama.cpp's venv, without jax / ftjax."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ftjax_runinfo", REPO / "ftjax" / "runinfo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RUNINFO = _runinfo()
commit_info, machine_info, run_fields = RUNINFO.commit_info, RUNINFO.machine_info, RUNINFO.run_fields


def commit() -> dict:
    return commit_info()


def machine() -> dict:
    return machine_info()


def quantize(src: str, out: str, ftype: str, threads: int | None) -> None:
    """llama.cpp's own quantizer (llama-quantize) on a bf16 GGUF: Q8_0, Q4_0 or Q4_K_M."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.nthread = threads or len(os.sched_getaffinity(0))
    t0 = time.perf_counter()
    if llama_cpp.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed: {src} -> {out} ({ftype})")
    print(json.dumps({"quantized": out, "ftype": ftype, "bytes": os.path.getsize(out),
                      "seconds": round(time.perf_counter() - t0, 1)}))


def no_extra_buffer_types() -> None:
    """Load without the CPU "extra buffer types" (weight repacking): that path of this
    llama.cpp build segfaulted on quantised MoE GGUFs on this machine class."""
    import llama_cpp

    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = params


def convert(model_dir: str, llama_src: str, out: str, outtype: str = "bf16") -> None:
    sys.path.insert(0, llama_src)
    sys.path.insert(1, str(Path(llama_src) / "gguf-py"))
    import convert_hf_to_gguf as conv
    from conversion.base import TextModel

    def set_vocab(self):  # no tokenizer in the folder: llama.cpp's "none" vocabulary
        self._set_vocab_none()
        self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    if not (Path(model_dir) / "tokenizer.json").exists():  # every architecture (qwen3moe, olmoe, ...)
        for cls in [TextModel, *subclasses(TextModel)]:
            cls.set_vocab = set_vocab
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outtype", outtype, "--outfile", out]
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config.get("architectures", [""])[0].startswith(("Qwen3_5", "Qwen3Next")) and "mtp" not in json.dumps(config):
        sys.argv.append("--no-mtp")  # geometry checkpoints carry no multi-token-prediction head
    t0 = time.perf_counter()
    conv.main()
    print(json.dumps({"converted": out, "bytes": os.path.getsize(out), "seconds": round(time.perf_counter() - t0, 1)}))


def last_argmax(llm) -> int:
    """Greedy token from the logits of the last evaluated token, read in place."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))))


def bench(args) -> None:
    import llama_cpp
    from llama_cpp import Llama

    threads = len(os.sched_getaffinity(0)) if args.threads is None else args.threads
    t0 = time.perf_counter()
    llm = Llama(model_path=args.gguf, n_ctx=max(128, args.prompt + args.new + 8), n_batch=args.prompt, n_ubatch=args.prompt, n_threads=threads,
                n_threads_batch=threads, use_mmap=True, verbose=False)
    load_s = time.perf_counter() - t0
    V = llm.n_vocab()
    prompt = [int(t) for t in np.random.RandomState(0).randint(0, V, size=args.prompt)]

    def run():
        llm.reset()
        llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
        t0 = time.perf_counter()
        llm.eval(prompt)
        t_prompt = time.perf_counter() - t0
        toks, stamps, c0 = [], [time.perf_counter()], time.process_time()
        for _ in range(args.new - 1):
            tok = last_argmax(llm)
            toks.append(tok)
            llm.eval([tok])
            stamps.append(time.perf_counter())
        cpu_ms = (time.process_time() - c0) / (args.new - 1) * 1e3
        toks.append(last_argmax(llm))
        perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
        return t_prompt, list(np.diff(stamps)), toks, perf, cpu_ms

    run()  # warm-up (page-in of the mmap, thread start)
    t_prompt, ts, toks, perf, cpu_ms = run()
    step = statistics.median(ts)
    print(json.dumps({
        "bench": "decode_llamacpp", **commit(), "machine": machine(), "gguf": args.gguf,
        "llama_cpp_python": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode()[:300],
        "threads": threads, "prompt_tokens": args.prompt, "new_tokens": args.new, "greedy": True,
        "load_s": round(load_s, 2), "prompt_eval_ms": round(t_prompt * 1e3, 2),
        "prompt_tok_per_s": round(args.prompt / t_prompt, 2), "tok_per_s": round(1 / step, 3),
        "step_ms": round(step * 1e3, 3), "cpu_ms_per_token": round(cpu_ms, 3), "p90_ms": round(float(np.percentile(ts, 90)) * 1e3, 3),
        "llama_perf": {"t_p_eval_ms": perf.t_p_eval_ms, "n_p_eval": perf.n_p_eval, "t_eval_ms": perf.t_eval_ms,
                       "n_eval": perf.n_eval},
        "distinct_tokens": len(set(toks)), "first_tokens": toks[:8], **run_fields()}), flush=True)


def run_llama_bench(binary: str, gguf: str, prompts: list[int], new: int, threads: int, rounds: int,
                    depths: list[int] = (0,)) -> list[dict]:
    """llama.cpp's own llama-bench (its AVX-512 path: `--repack 0`) -> its jsonl records:
    one per test (pp of each prompt length, tg of `new` tokens; each at every depth: that
    many tokens already in the K/V cache), each with its rounds."""
    import subprocess

    cmd = [binary, "-m", gguf, "-p", ",".join(map(str, prompts)), "-n", str(new), "-t", str(threads),
           "-r", str(rounds), "-d", ",".join(map(str, depths)), "--repack", "0", "-o", "jsonl"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def llama_bench(args) -> None:
    """llama-bench's pp and tg, one line per round."""
    threads = len(os.sched_getaffinity(0)) if args.threads is None else args.threads
    tests = run_llama_bench(args.llama_bench, args.gguf, [args.prompt], args.new, threads, args.rounds)
    pp = next(t for t in tests if t["n_prompt"] == args.prompt and t["n_gen"] == 0)
    tg = next(t for t in tests if t["n_gen"] == args.new and t["n_prompt"] == 0)
    for r, (p_ts, g_ts) in enumerate(zip(pp["samples_ts"], tg["samples_ts"]), 1):
        print(json.dumps({
            "bench": "decode_llamacpp", **commit(), "machine": machine(), "gguf": args.gguf,
            "llama_bench": {"build_commit": pp["build_commit"], "repack": pp["repack"], "type_k": pp["type_k"],
                            "n_ubatch": pp["n_ubatch"], "tg_from": "an empty context"},
            "threads": threads, "prompt_tokens": args.prompt, "new_tokens": args.new, "round": r,
            "prompt_tok_per_s": round(float(p_ts), 2), "tok_per_s": round(float(g_ts), 3), **run_fields()}),
            flush=True)


def llama_bench_contexts(args) -> None:
    """llama-bench's tg of `--new` tokens at each of `--contexts` tokens already held (its
    depth), one line per context with the median round: the llama.cpp side of
    scripts/bench_context.py, with llama.cpp's native build."""
    threads = len(os.sched_getaffinity(0)) if args.threads is None else args.threads
    tests = run_llama_bench(args.llama_bench, args.gguf, [0], args.new, threads, args.rounds, args.contexts)
    for t in sorted((t for t in tests if t["n_gen"] == args.new), key=lambda t: t["n_depth"]):
        ms = [1e3 / float(ts) for ts in t["samples_ts"]]
        print(json.dumps({"bench": "context_llamacpp", "gguf": args.gguf, "context": t["n_depth"], "threads": threads,
                          "ms_per_token": round(statistics.median(ms), 2), "rounds_ms": [round(x, 2) for x in ms],
                          "steps": args.new, "type_k": t["type_k"],
                          "llama_bench": {"build_commit": t["build_commit"], "repack": t["repack"]},
                          **commit(), "machine": machine(), **run_fields()}), flush=True)


def contexts(args) -> None:
    """Prefill of a `ctx`-token prompt, then `--new` decode steps at that context, for each
    of `--contexts` (fresh KV each time): the llama.cpp side of scripts/bench_context.py
    (ftjax's decode at a context) and of the long-prompt prefill comparison."""
    import llama_cpp
    from llama_cpp import Llama

    threads = len(os.sched_getaffinity(0)) if args.threads is None else args.threads
    n_ctx = max(args.contexts) + args.new + 64
    llm = Llama(model_path=args.gguf, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, use_mmap=True, verbose=False)
    V = llm.n_vocab()
    rng = np.random.RandomState(0)
    for ctx in args.contexts:
        prompt = [int(t) for t in rng.randint(0, V, size=ctx)]
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill_s = time.perf_counter() - t0
        stamps = [time.perf_counter()]
        for _ in range(args.new):
            llm.eval([last_argmax(llm)])
            stamps.append(time.perf_counter())
        ms = statistics.median(np.diff(stamps)) * 1e3
        print(json.dumps({"bench": "context_llamacpp", "gguf": args.gguf, "context": ctx, "threads": threads,
                          "prefill_s": round(prefill_s, 2), "prefill_tok_per_s": round(ctx / prefill_s, 1),
                          "ms_per_token": round(ms, 2), "steps": args.new, "n_ctx": n_ctx,
                          "llama_cpp_python": llama_cpp.__version__, **commit(), "machine": machine(),
                          **run_fields()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--convert", default=None, help="HF checkpoint folder to convert to --gguf (--outtype)")
    ap.add_argument("--outtype", default="bf16", help="convert_hf_to_gguf --outtype (bf16, q8_0, f32)")
    ap.add_argument("--quantize", nargs=2, metavar=("SRC_GGUF", "FTYPE"), default=None,
                    help="llama.cpp's quantizer: SRC_GGUF -> --gguf as FTYPE (q8_0, q4_0, q4_k_m)")
    ap.add_argument("--extra-bufts", action="store_true", help="keep the CPU weight-repacking buffer types")
    ap.add_argument("--llama-src", default="/tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp")
    ap.add_argument("--gguf", default="/tmp/ftjax-geom-bf16.gguf")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--contexts", nargs="+", type=int, default=None,
                    help="prefill a prompt of each length, then decode --new tokens at that context")
    ap.add_argument("--llama-bench", default=None, help="run this llama-bench binary (--repack 0) instead of the binding")
    ap.add_argument("--rounds", type=int, default=3, help="llama-bench repetitions (one line each)")
    RUNINFO.add_allow_dirty_argument(ap)
    args = ap.parse_args()
    if not (args.convert or args.quantize):  # the measuring modes write raw lines
        RUNINFO.check_clean_or_exit(args.allow_dirty)
    if args.llama_bench:
        return llama_bench_contexts(args) if args.contexts else llama_bench(args)
    if not args.extra_bufts and not args.convert:
        no_extra_buffer_types()
    if args.convert:
        convert(args.convert, args.llama_src, args.gguf, args.outtype)
    elif args.quantize:
        quantize(args.quantize[0], args.gguf, args.quantize[1], args.threads)
    elif args.contexts:
        contexts(args)
    else:
        bench(args)


if __name__ == "__main__":
    main()
