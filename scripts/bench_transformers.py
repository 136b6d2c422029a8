"""Hugging Face transformers (torch CPU) on the same checkpoint: the reference baseline.

Same prompt ids as scripts/bench_decode.py (RandomState(0), --prompt ids), greedy
`generate` of --new tokens (EOS disabled), torch threads = --threads and the process
pinned to that many cores. Per-token times come from a logits processor that stamps
each call (call 0 ends the prefill); one warm-up generation first; medians.

    OPENBLAS_NUM_THREADS=1 nice -n 5 python scripts/bench_transformers.py --model /tmp/ftjax-geom \\
        --threads 2 --dtype bf16 fp32
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__" and "--threads" in sys.argv:
    n = int(sys.argv[sys.argv.index("--threads") + 1])
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:n]))

import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields  # noqa: E402,E501
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def commit() -> dict:
    return commit_info()


def machine() -> dict:
    return machine_info()


class Stamp(LogitsProcessor):
    def __init__(self):
        self.t: list[float] = []
        self.cpu: list[float] = []

    def __call__(self, input_ids, scores):
        self.t.append(time.perf_counter())
        self.cpu.append(time.process_time())
        return scores


def bench(model_dir: str, dtype: str, threads: int, prompt_len: int, new: int) -> None:
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
    load_s = time.perf_counter() - t0
    V = model.config.vocab_size
    ids = torch.tensor([np.random.RandomState(0).randint(0, V, size=prompt_len).tolist()])

    def gen(n):
        st = Stamp()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, logits_processor=LogitsProcessorList([st]))
        return t0, st, out[0, prompt_len:].tolist()

    gen(8)  # warm-up
    t0, st, toks = gen(new)
    stamps = st.t
    ts = list(np.diff(stamps))
    cpu_ms = (st.cpu[-1] - st.cpu[0]) / (len(st.cpu) - 1) * 1e3
    step = statistics.median(ts)
    print(json.dumps({
        "bench": "decode_transformers", **commit(), "machine": machine(), "model_dir": model_dir,
        "transformers": transformers.__version__, "torch": torch.__version__, "dtype": dtype, "threads": threads,
        "prompt_tokens": prompt_len, "new_tokens": new, "greedy": True, "load_s": round(load_s, 2),
        "prefill_ms": round((stamps[0] - t0) * 1e3, 2), "prompt_tok_per_s": round(prompt_len / (stamps[0] - t0), 2),
        "tok_per_s": round(1 / step, 3), "step_ms": round(step * 1e3, 3), "cpu_ms_per_token": round(cpu_ms, 3),
        "p90_ms": round(float(np.percentile(ts, 90)) * 1e3, 3), "first_tokens": toks[:8], **run_fields()}),
          flush=True)
    del model
    gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/ftjax-geom")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    add_allow_dirty_argument(ap)
    args = ap.parse_args()
    check_clean_or_exit(args.allow_dirty)
    for d in args.dtype:
        bench(args.model, d, args.threads, args.prompt, args.new)


if __name__ == "__main__":
    main()
