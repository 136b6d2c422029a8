"""`ftjax serve` under load and failure, as agents meet it: the real server in a
subprocess, the official SDKs as clients.

- 8 and 32 concurrent requests, distinct and with a shared prefix, under every state
  cache mode: every request is answered, with the tokens of a cold `Model.generate`.
- A full queue answers 429 (OpenAI) / 529 overloaded_error (Anthropic) with Retry-After.
- A fault injected inside the server's steps fails that request with a 500 naming it;
  the next request gets the right answer; /metrics counts both.
- SIGTERM under load: the server stops admitting, every client gets an answer (its
  result, or an error once the drain deadline passes), and the process exits in time.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

import ftjax  # noqa: E402
import serving  # noqa: E402

MODEL = "ftjax-default"
GREEDY = {"temperature": 0}  # the anthropic SDK no longer takes temperature as an argument
N_NEW = 5
PREFIX = "You are a careful assistant. Answer in the style of Jane Austen. " * 6


@pytest.fixture(scope="module")
def model():
    return ftjax.load()


def clients(port):
    return (openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120),
            anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="unused", max_retries=0, timeout=120))


def ask(port, i: int, text: str, max_tokens: int = N_NEW) -> str:
    """Request i through one of the two APIs (streaming every third) -> the reply text."""
    oai, ant = clients(port)
    messages = [{"role": "user", "content": text}]
    stream = i % 3 == 0
    if i % 2 == 0:
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True) if c.choices)
        return oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                           temperature=0).choices[0].message.content
    if stream:
        with ant.messages.stream(model=MODEL, messages=messages, max_tokens=max_tokens, extra_body=GREEDY) as s:
            return "".join(s.text_stream)
    r = ant.messages.create(model=MODEL, messages=messages, max_tokens=max_tokens, extra_body=GREEDY)
    return "".join(b.text for b in r.content if b.type == "text")


def reference(model, text: str, n: int = N_NEW) -> str:
    ids = model.tokenizer.encode_chat([{"role": "user", "content": text}])
    return model.tokenizer.decode(model.generate(ids, n)).strip()


def metrics(port) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.mark.parametrize("mode", ["off", "prefix", "semantic"])
def test_concurrent_distinct_and_shared_prefix_requests_all_answered(model, mode):
    texts = [f"Tell me of {i}" for i in range(8)] + [PREFIX + f"Who is person {i}?" for i in range(24)]
    want = {t: reference(model, t) for t in set(texts)}
    with serving.server("--state-cache", mode, "--max-batch", "4") as port:
        for batch in (texts[:8], texts):  # 8 at once, then 32 at once (the first 8 again: cached)
            with ThreadPoolExecutor(len(batch)) as pool:
                got = list(pool.map(lambda it: ask(port, *it), enumerate(batch)))
            assert got == [want[t] for t in batch]
        m = metrics(port)
        assert m['ftjax_requests_total{outcome="length"}'] + m.get('ftjax_requests_total{outcome="eos"}', 0) == 40
        assert m["ftjax_queue_depth"] == 0 and m["ftjax_running_rows"] == 0 and m["ftjax_up"] == 1
        assert m["ftjax_time_to_first_token_seconds_count"] == 40
        if mode != "off":
            assert m['ftjax_prompt_tokens_total{source="state_cache"}'] > 0
        assert serving.get_json(port, "/health")["status"] == "ok"


def test_full_queue_is_429_or_529_with_retry_after(model):
    with serving.server("--state-cache", "off", "--max-batch", "1", "--max-queue", "1") as port:
        def call(i):
            try:
                return "ok", ask(port, [1, 2, 4, 5, 7, 8, 10, 11][i], "Tell me a long story", max_tokens=200)
            except (openai.RateLimitError, anthropic.APIStatusError) as e:
                return e.status_code, e.response.headers.get("retry-after"), e.body
        with ThreadPoolExecutor(8) as pool:
            out = list(pool.map(call, range(8)))
        refused = [o for o in out if o[0] != "ok"]
        assert refused and len(out) - len(refused) >= 2  # one running, one queued at least
        for status, retry_after, body in refused:
            assert retry_after == "1"
            kind = body["error"]["type"] if status == 529 else body["type"]  # Anthropic's body / OpenAI's error
            assert (status, kind) in ((429, "rate_limit_error"), (529, "overloaded_error")), (status, body)
        assert metrics(port)['ftjax_refused_requests_total{kind="overloaded_error",status="429"}'] == len(refused)
        assert ask(port, 0, "Hello") == reference(model, "Hello")  # serving as before


def test_injected_step_fault_fails_one_request_and_the_next_is_right(model):
    env = {**os.environ, "FTJAX_FAULTS": "decode:1"}
    with serving.server("--state-cache", "semantic", env=env) as port:
        oai, _ = clients(port)
        with pytest.raises(openai.InternalServerError, match="injected fault at 'decode'"):
            oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
        assert ask(port, 0, "Hello") == reference(model, "Hello")
        m = metrics(port)
        assert m['ftjax_requests_total{outcome="error"}'] == 1 and m['ftjax_requests_total{outcome="length"}'] == 1
        assert serving.get_json(port, "/health")["status"] == "ok"


def test_sigterm_under_load_answers_every_client_and_exits():
    port = serving.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ftjax.cli", "serve", "--port", str(port), "--drain-s", "2",
                             "--max-batch", "2", "--state-cache", "off"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1],
                            env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while not serving.healthy(port):
            assert proc.poll() is None and time.time() < deadline, "server did not come up"
            time.sleep(0.3)
        results = {}

        def call(i):
            try:
                results[i] = ("ok", ask(port, i, f"Tell me story {i}", max_tokens=1500))
            except Exception as e:  # an answer all the same: a status or a stream's error event
                results[i] = ("error", f"{type(e).__name__}: {e}")
        threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(3)  # some decode, some wait in the queue
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        exit_s = time.time() - t0
        for t in threads:
            t.join(30)
        assert all(not t.is_alive() for t in threads), "a client was left waiting"
        assert len(results) == 6 and exit_s < 15, (results, exit_s)
        errors = [r for kind, r in results.values() if kind == "error"]
        assert errors and all("shut down" in e or "Connection" in e or "overloaded" in e.lower() for e in errors), \
            errors
    finally:
        if proc.poll() is None:
            proc.kill()
        stderr = proc.stderr.read() if proc.stderr else ""
    assert "shutting down" in stderr
