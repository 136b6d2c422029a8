"""Soak benchmark of `ftjax serve`: many requests at a fixed concurrency, mixed prompt
lengths, output lengths, APIs (OpenAI / Anthropic SDKs) and streaming.

Starts the real server in a subprocess (embedded model unless --model), warms it up
with one request per API, then sends --requests requests from --concurrency client
threads. Each request draws: a prompt of 5-1500 tokens (passages of public-domain text
behind a chat instruction; at most ~1,550 tokens, so prompt + 128 fit the 2,048 context), max_tokens 8-128, streaming or not, greedy or sampled, one
of the two APIs. Per request it records the latency (send to last byte) and, when
streaming, the TTFT (send to the first generated text). The server compiles its
programs before listening (`--warmup`, timed apart); its RSS is read from /proc after
the warm-up, once a second during the run (quartiles reported) and at the end (with
its peak). Prints ONE JSON line: failures,
p50 / p95 / max latency and TTFT, total completion tokens / s, RSS, commit and machine.

    OPENBLAS_NUM_THREADS=1 python scripts/bench_serve.py [--requests 1000] [--concurrency 8] [--max-batch 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import anthropic  # noqa: E402
import openai  # noqa: E402

from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields  # noqa: E402,E501

MODEL = "ftjax-default"
PASSAGE = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
           "want of a wife. However little known the feelings or views of such a man may be on his first entering "
           "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
           "considered the rightful property of some one or other of their daughters. ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ftjax.cli", "serve", "--port", str(port), "--max-batch", str(args.max_batch),
           "--warmup"]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited: " + proc.stderr.read())
        try:
            client.models.list()
            return proc
        except openai.APIConnectionError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not come up")


def rss(pid: int) -> dict:
    out = {}
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(("VmRSS:", "VmHWM:")):
            out["rss_mib" if line.startswith("VmRSS") else "peak_rss_mib"] = round(int(line.split()[1]) / 1024, 1)
    return out


def draw(rng: random.Random) -> dict:
    words = PASSAGE.split()
    n = int(rng.choice([5, 20, 60, 200, 500, 1100]) * rng.uniform(0.5, 1.0))  # words (~1.4 tokens each)
    text = " ".join(words[i % len(words)] for i in range(rng.randrange(len(words)), rng.randrange(len(words)) + n))
    return {"prompt": "Continue this passage:\n" + text, "max_tokens": rng.choice([8, 16, 32, 64, 128]),
            "stream": rng.random() < 0.5, "api": rng.choice(["openai", "anthropic"]),
            "sampling": {"temperature": 0} if rng.random() < 0.5 else {"temperature": 0.8, "seed": rng.randrange(99)}}


def one(clients, spec: dict) -> dict:
    """Send one request -> {latency_s, ttft_s (streaming), tokens}."""
    msgs = [{"role": "user", "content": spec["prompt"]}]
    t0 = time.perf_counter()
    ttft = None
    if spec["api"] == "openai":
        kw = dict(model=MODEL, messages=msgs, max_tokens=spec["max_tokens"], **spec["sampling"])
        if spec["stream"]:
            tokens = 0
            for c in clients["openai"].chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                               **kw):
                if ttft is None and c.choices and (c.choices[0].delta.content or
                                                   getattr(c.choices[0].delta, "reasoning_content", None)):
                    ttft = time.perf_counter() - t0
                if c.usage:
                    tokens = c.usage.completion_tokens
        else:
            tokens = clients["openai"].chat.completions.create(**kw).usage.completion_tokens
    else:
        sampling = {k: v for k, v in spec["sampling"].items() if k != "seed"}  # the Messages API has no seed
        kw = dict(model=MODEL, messages=msgs, max_tokens=spec["max_tokens"], extra_body=sampling)
        if spec["stream"]:
            with clients["anthropic"].messages.stream(**kw) as s:
                for e in s:
                    if ttft is None and e.type == "content_block_delta":
                        ttft = time.perf_counter() - t0
                tokens = s.get_final_message().usage.output_tokens
        else:
            tokens = clients["anthropic"].messages.create(**kw).usage.output_tokens
    return {"latency_s": time.perf_counter() - t0, "ttft_s": ttft, "tokens": tokens}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=4, help="the server's --max-batch")
    ap.add_argument("--seed", type=int, default=0)
    add_allow_dirty_argument(ap)
    a = ap.parse_args(argv)
    check_clean_or_exit(a.allow_dirty)
    port = _free_port()
    proc = start_server(a, port)
    try:
        clients = {"openai": openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                           timeout=600),
                   "anthropic": anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="unused",
                                                    max_retries=0, timeout=600)}
        rng = random.Random(a.seed)
        for api in ("openai", "anthropic"):  # warm-up: compiles the first shapes
            one(clients, {**draw(rng), "api": api})
        rss_start = rss(proc.pid)
        specs = [draw(rng) for _ in range(a.requests)]
        results, failures, lock = [], [], threading.Lock()

        def run(spec):
            try:
                r = one(clients, spec)
                with lock:
                    results.append({**r, "stream": spec["stream"]})
            except Exception as e:  # counted, not raised: the soak reports every failure
                with lock:
                    failures.append(f"{type(e).__name__}: {e}"[:200])

        samples, done = [], threading.Event()  # server RSS once a second: is it bounded?

        def sample():
            while not done.wait(1.0):
                samples.append(rss(proc.pid)["rss_mib"])

        sampler = threading.Thread(target=sample)
        sampler.start()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(a.concurrency) as pool:
            list(pool.map(run, specs))
        wall = time.perf_counter() - t0
        done.set()
        sampler.join()
        rss_end = rss(proc.pid)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/stats") as r:
            stats = json.load(r)
    finally:
        proc.terminate()
        proc.wait(30)
    lat = [r["latency_s"] for r in results]
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    tokens = sum(r["tokens"] for r in results)
    line = {"bench": "serve_soak", "model": a.model or MODEL, "requests": a.requests, "concurrency": a.concurrency,
            "max_batch": a.max_batch, "ok": len(results), "failed": len(failures), "failures": failures[:5],
            "streamed": sum(r["stream"] for r in results), "wall_s": round(wall, 2),
            "latency_s": {"p50": pct(lat, 0.5), "p95": pct(lat, 0.95), "max": pct(lat, 1.0)},
            "ttft_s": {"p50": pct(ttft, 0.5), "p95": pct(ttft, 0.95), "max": pct(ttft, 1.0)},
            "completion_tokens": tokens, "total_tok_per_s": round(tokens / wall, 2),
            "server_rss_start_mib": rss_start.get("rss_mib"), "server_rss_end_mib": rss_end.get("rss_mib"),
            "server_rss_quartiles_mib": [samples[int(q * (len(samples) - 1))] for q in (0.25, 0.5, 0.75)]
            if samples else None,
            "server_peak_rss_mib": rss_end.get("peak_rss_mib"),
            "scheduler": stats.get("sessions") if isinstance(stats, dict) else None,
            **commit_info(), **machine_info(), **run_fields()}
    print(json.dumps(line), flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
