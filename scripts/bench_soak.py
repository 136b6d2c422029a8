"""Soak benchmark of `ftjax serve` through the real `openai` and `anthropic` SDKs: agent
sessions with rewritten histories, then many short requests. Does the server stay up,
answer every request, and keep its memory bounded?

Starts the real server in a subprocess on 127.0.0.1 (the embedded default model,
`--warmup`, the given `--max-batch` and `--state-cache`), waits for /health, and always
stops it at the end (SIGTERM, then kill).

Phase 1, agent sessions: --sessions conversations run concurrently, --turns requests
each. A conversation is a coding agent's: a system prompt, a user task, then per turn
the assistant's reply as the server returned it (its tool calls when it made some,
else its text) and a tool result message per call (a few hundred tokens of file text,
grep hits, listings or test logs, pseudo-random but seeded per session, --output-scale
pieces of it per output; a reply
without a call gets one result all the same, under an id of the harness's: the server
does not pair ids, and the history keeps one tool output per turn). Before each
request all but the last --keep-outputs tool outputs are replaced by "[output elided]",
as coding agents do, so the history is rewritten in the middle, and the oldest turns are
dropped while the history (counted by the server's /v1/messages/count_tokens) is over
--max-history tokens. The default model was trained with a context of 2,048 tokens;
`--context N` above that serves the same weights with its declared context raised to N
(a copy of the model folder whose config says max_position_embeddings = N, the rest
linked; RoPE positions past the training length, so the text is worse, the serving work
the same) — `--long` is the ≥ 8k-token profile: --context 16384, 5 whole outputs of 6
pieces each, --max-history 12000. Even sessions speak
OpenAI chat.completions, odd ones Anthropic messages; both stream, with 2 function
tools, max_tokens 48, temperature 0. Every other turn forces a call of `search_corpus`
(the tool the default model was trained on, asked for in the shape of its training),
so some replies are real tool calls; the tiny model often writes them malformed (then
they come back as text) and seldom calls a tool unforced.
Phase 2: --short one-line requests (max_tokens 1-16, either API, streaming or not) from
--concurrency client threads.

Per request: TTFT (send to the first streamed text / reasoning / tool-call delta) and
latency (send to the end). Every call has a client-side deadline (--timeout); one that
passes it counts as hung, and a session stops at its first hung request. The SDKs
never retry (max_retries=0). Errors are counted by kind: "STATUS:type" for an HTTP
error, "stream:type" for an error event inside a stream, "timeout", "connection", or
the exception's class. The server's RSS (/proc VmRSS) is read after the warm-up and
the first round of phase 1, after phase 1 (the baseline: every program compiled, the
state cache at its --state-cache-mib budget) and at the end; growth is end / baseline.

Prints ONE JSON line (progress goes to stderr): requests (generation requests; the
token counts are counted apart), hung, errors by kind (with a few samples), TTFT and
latency (p50 / p95 / max, ms) per phase and overall, RSS baseline / end / growth, the
longest history sent (max_history_tokens, as the server's usage reports it), turns
dropped, tool calls the model made, the server's scheduler and state-cache counters
and what its state cache holds at the end, its shutdown, its last log lines, commit
and machine. Exits 1 when a request hung or failed.

    OPENBLAS_NUM_THREADS=1 python scripts/bench_soak.py [--sessions 8] [--turns 20] [--short 1000]
        [--concurrency 8] [--max-batch 4] [--prefill-chunk 512] [--state-cache {off,prefix,semantic}] [--long] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve import MODEL, REPO, _free_port, one, pct, rss  # noqa: E402  (also puts REPO on sys.path)

import anthropic  # noqa: E402
import openai  # noqa: E402

from ftjax.bench.models import default_model_with_context  # noqa: E402
from ftjax.engine.scheduler import DEFAULT_PREFILL_CHUNK  # noqa: E402
from ftjax.runinfo import add_allow_dirty_argument, check_clean_or_exit, commit_info, machine_info, run_fields  # noqa: E402,E501

SYSTEM = ("You are a coding agent working in a Python repository. Use the tools to look at the code, "
          "then explain the fix briefly.")
# Tasks in the shape of the default model's tool-call training, so that a forced call can come out valid.
TASKS = [f'Find the passage of the {part} code that begins "{start}".'
         for part, start in [("cache", "def evict"), ("scheduler", "def admit"),
                             ("parser", "def parse_tools"), ("server", "async def stream"),
                             ("tokenizer", "def encode"), ("router", "def top_k"), ("session", "class Session"),
                             ("engine", "def step")]]
TOOLS = [  # search_corpus(book, query): the call the default model was trained on, so it can write valid ones
    {"type": "function", "function": {
        "name": "search_corpus", "description": "Search the repository's files for a text.",
        "parameters": {"type": "object", "properties": {"book": {"type": "string"}, "query": {"type": "string"}},
                       "required": ["book", "query"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Return the text of a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
FORCED_TOOL = "search_corpus"
ELIDED = "[output elided]"
AGENT_MAX_TOKENS = 48
WORDS = ("cache state session request engine model token batch prefill decode expert router layer tensor buffer "
         "stream config parser handler server client index table schema queue worker scheduler snapshot").split()
DIRS = ["src/ftjax", "src/ftjax/serve", "src/ftjax/engine", "tests", "scripts", "docs"]
QUESTIONS = ["What does this function return?", "Name a prime number.", "Say hello.", "Is the cache warm?",
             "Continue: once upon a time", "Give one word for fast.", "What is two plus two?", "Write a haiku."]


# ---- the server -----------------------------------------------------------------------------

def start_server(a, port: int, log) -> subprocess.Popen:
    """`ftjax serve` on 127.0.0.1:port, its stderr to `log`; returns once /health answers."""
    tier_gb = str(a.state_cache_mib / 2 / 1024)  # half on the device tier, half on the host tier
    cmd = [sys.executable, "-m", "ftjax.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--warmup",
           "--max-batch", str(a.max_batch), "--prefill-chunk", str(a.prefill_chunk), "--state-cache", a.state_cache,
           "--state-cache-device-gb", tier_gb, "--state-cache-host-gb", tier_gb]
    if a.model_dir is not None:
        cmd += ["--model", str(a.model_dir), "--served-model-name", MODEL]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + a.startup_timeout
    while not healthy(port):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server_log(log)}")
        if time.time() > deadline:
            stop_server(proc)
            raise RuntimeError("server did not come up")
        time.sleep(0.5)
    return proc


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def stop_server(proc: subprocess.Popen, grace_s: float = 30) -> float | None:
    """SIGTERM, then SIGKILL after grace_s -> seconds the graceful shutdown took (None: killed)."""
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
        return round(time.perf_counter() - t0, 2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def server_log(log) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")


def server_stats(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/stats", timeout=60) as r:
        stats = json.load(r)
    cache = stats.get("state_cache") or {}
    held = {tier: round(n / 2**20, 1) for tier, n in (cache.get("bytes") or {}).items()}
    return {"scheduler": stats.get("sessions"),
            "state_cache_counters": {k: cache.get(k) for k in ("lookups", "hits", "misses", "tokens_reused",
                                                               "tokens_prefilled", "dropped") if k in cache} or None,
            "state_cache_mib": held or None}  # what the cache holds at the end: part of the RSS growth


# ---- fake tool outputs (deterministic in the session's rng) ---------------------------------

def _ident(rng: random.Random) -> str:
    return f"{rng.choice(WORDS)}_{rng.choice(WORDS)}"


def _path(rng: random.Random) -> str:
    return f"{rng.choice(DIRS)}/{_ident(rng)}.py"


def _code(rng: random.Random) -> str:
    lines = []
    for _ in range(6):
        lines += [f"def {_ident(rng)}(self, {rng.choice(WORDS)}):",
                  f"    {rng.choice(WORDS)} = self.{_ident(rng)}({rng.choice(WORDS)})",
                  f"    return {rng.choice(WORDS)}.{rng.choice(WORDS)}"]
    return "\n".join(lines)


def _grep(rng: random.Random) -> str:
    return "\n".join(f"{_path(rng)}:{rng.randrange(1, 400)}:    self.{_ident(rng)}({rng.choice(WORDS)})"
                     for _ in range(9))


def _listing(rng: random.Random) -> str:
    return "\n".join(_path(rng) for _ in range(15))


def _tests(rng: random.Random) -> str:
    return "\n".join(f"tests/test_{rng.choice(WORDS)}.py::test_{_ident(rng)} {rng.choice(['PASSED', 'FAILED'])}"
                     for _ in range(10))


TOOL_OUTPUT = {"search_corpus": _grep, "read_file": _code}
COMMAND_OUTPUTS = [_listing, _tests, _code, _grep]


# ---- conversations --------------------------------------------------------------------------

@dataclass
class Call:
    id: str
    name: str
    arguments: str  # JSON text, as the server wrote it


@dataclass
class Reply:
    text: str
    calls: list[Call]
    prompt_tokens: int | None
    ttft_s: float | None
    latency_s: float


@dataclass
class Turn:
    """One assistant reply and the tool results answering it: one per tool call, or (no
    call) one under an id of the harness's, the output of the agent's next command."""
    text: str
    calls: list[Call]
    outputs: list[str]
    result_ids: list[str]


@dataclass
class Session:
    index: int
    rng: random.Random
    task: str
    turns: list[Turn] = field(default_factory=list)
    steps: int = 0
    dropped_turns: int = 0
    tool_calls: int = 0
    stopped: bool = False
    keep_outputs: int = 3  # tool outputs left whole; older ones are elided
    output_scale: int = 1  # generated pieces per tool output

    @property
    def api(self) -> str:
        return "openai" if self.index % 2 == 0 else "anthropic"

    def add(self, reply: Reply) -> None:
        """Append the reply and the outputs answering it, then elide all but the last outputs."""
        self.tool_calls += len(reply.calls)
        if reply.calls:
            outputs = [self.output(TOOL_OUTPUT.get(c.name, _code)) for c in reply.calls]
            ids = [c.id for c in reply.calls]
        else:  # the server does not pair result ids with calls; the template renders a <tool_output> all the same
            outputs, ids = [self.output(self.rng.choice(COMMAND_OUTPUTS))], [f"harness_{self.index}_{self.steps}"]
        self.turns.append(Turn(reply.text, reply.calls, outputs, ids))
        self.elide()

    def output(self, piece) -> str:
        return "\n".join(piece(self.rng) for _ in range(self.output_scale))

    def elide(self) -> None:
        outputs = [(t, i) for t in self.turns for i in range(len(t.outputs))]
        for t, i in outputs[:-self.keep_outputs]:
            t.outputs[i] = ELIDED

    def openai_messages(self) -> list[dict]:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.task}]
        for t in self.turns:
            calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                     for c in t.calls]
            msgs.append({"role": "assistant", "content": t.text, **({"tool_calls": calls} if calls else {})})
            msgs += [{"role": "tool", "tool_call_id": i, "content": out} for i, out in zip(t.result_ids, t.outputs)]
        return msgs

    def anthropic_messages(self) -> list[dict]:
        msgs = [{"role": "user", "content": self.task}]
        for t in self.turns:
            text = [{"type": "text", "text": t.text}] if t.text or not t.calls else []
            msgs.append({"role": "assistant", "content": text + [
                {"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)} for c in t.calls]})
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": out}
                                                     for i, out in zip(t.result_ids, t.outputs)]})
        return msgs


def history_tokens(client: anthropic.Anthropic, s: Session) -> int:
    """The prompt's length as the server counts it (template, tools and all)."""
    return client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=s.anthropic_messages(),
                                        tools=ANTHROPIC_TOOLS).input_tokens


def trim(client: anthropic.Anthropic, s: Session, max_tokens: int) -> int:
    """Drop the oldest turns while the history is over max_tokens (the last turn stays)
    -> the history's tokens."""
    while (n := history_tokens(client, s)) > max_tokens and len(s.turns) > 1:
        s.turns.pop(0)
        s.dropped_turns += 1
    return n


# ---- one agent request per API --------------------------------------------------------------

def openai_turn(client: openai.OpenAI, s: Session, forced: bool) -> Reply:
    t0, ttft, text, calls, prompt = time.perf_counter(), None, [], {}, None
    choice = {"type": "function", "function": {"name": FORCED_TOOL}} if forced else "auto"
    stream = client.chat.completions.create(model=MODEL, messages=s.openai_messages(), tools=TOOLS,
                                            tool_choice=choice, max_tokens=AGENT_MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage:
            prompt = chunk.usage.prompt_tokens
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        if ttft is None and (d.content or d.tool_calls or getattr(d, "reasoning_content", None)):
            ttft = time.perf_counter() - t0
        text.append(d.content or "")
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, Call("", "", ""))
            c.id = tc.id or c.id
            if tc.function:
                c.name += tc.function.name or ""
                c.arguments += tc.function.arguments or ""
    return Reply("".join(text), list(calls.values()), prompt, ttft, time.perf_counter() - t0)


def anthropic_turn(client: anthropic.Anthropic, s: Session, forced: bool) -> Reply:
    t0, ttft = time.perf_counter(), None
    choice = {"type": "tool", "name": FORCED_TOOL} if forced else {"type": "auto"}
    with client.messages.stream(model=MODEL, system=SYSTEM, messages=s.anthropic_messages(), tools=ANTHROPIC_TOOLS,
                                tool_choice=choice, max_tokens=AGENT_MAX_TOKENS,
                                extra_body={"temperature": 0}) as stream:  # no temperature kwarg in this SDK
        for e in stream:
            if ttft is None and e.type == "content_block_delta":
                ttft = time.perf_counter() - t0
        m = stream.get_final_message()
    text = "".join(b.text for b in m.content if b.type == "text")
    calls = [Call(b.id, b.name, json.dumps(b.input)) for b in m.content if b.type == "tool_use"]
    prompt = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    return Reply(text, calls, prompt, ttft, time.perf_counter() - t0)


# ---- deadlines, errors and the tally --------------------------------------------------------

class Hung(Exception):
    """The call passed its client-side deadline."""


HUNG = object()  # Tally.call's answer for a call that hung (None: for one that failed otherwise)


def with_deadline(fn, seconds: float):
    """fn() in a daemon thread; Hung when it has not returned after `seconds` (the thread
    is abandoned: it ends when the server closes its connection at shutdown)."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise Hung(f"no answer after {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def error_kind(e: BaseException) -> str:
    if isinstance(e, (Hung, openai.APITimeoutError, anthropic.APITimeoutError)):
        return "timeout"
    if isinstance(e, (openai.APIConnectionError, anthropic.APIConnectionError)):
        return "connection"
    body = getattr(e, "body", None)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):  # Anthropic: the whole error JSON
        body = body["error"]
    kind = getattr(e, "type", None) or (body.get("type") if isinstance(body, dict) else None) or "error"
    status = getattr(e, "status_code", None)
    if isinstance(e, (openai.APIError, anthropic.APIError)) and status in (None, 200):  # an error event in a stream
        return f"stream:{kind}"
    return f"{status}:{kind}" if status else type(e).__name__


class Tally:
    """Requests, latencies and TTFTs per phase, errors by kind; thread-safe."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.requests = Counter()
        self.latency = {"agent": [], "short": []}
        self.ttft = {"agent": [], "short": []}
        self.errors = Counter()
        self.samples: list[str] = []
        self.max_history = 0
        self.histories: list[int] = []  # prompt tokens of each agent request, as the server counted them

    def call(self, phase: str | None, fn):
        """fn() under the deadline -> its result, HUNG, or None after another failure (each
        counted). fn returns a Reply or bench_serve.one's dict; phase None: a helper call
        (token count), counted apart and not timed."""
        with self.lock:
            self.requests[phase or "count_tokens"] += 1
        try:
            r = with_deadline(fn, self.timeout_s + 5)  # the SDK's own timeout fires first, when it can
        except Exception as e:  # counted, not raised: the soak reports every failure
            kind = error_kind(e)
            with self.lock:
                self.errors[kind] += 1
                if len(self.samples) < 5:
                    self.samples.append(f"{phase or 'count_tokens'} {kind}: {type(e).__name__}: {e}"[:240])
            return HUNG if kind == "timeout" else None
        if phase is not None:
            latency, ttft = (r["latency_s"], r["ttft_s"]) if isinstance(r, dict) else (r.latency_s, r.ttft_s)
            with self.lock:
                self.latency[phase].append(latency)
                if ttft is not None:
                    self.ttft[phase].append(ttft)
        return r

    def history(self, tokens: int | None) -> None:
        with self.lock:
            self.max_history = max(self.max_history, tokens or 0)
            if tokens:
                self.histories.append(tokens)


# ---- the two phases -------------------------------------------------------------------------

def session_step(s: Session, clients: dict, tally: Tally, max_history: int) -> None:
    """One agent turn: trim the history, send it, append the reply and the tool outputs."""
    forced = s.steps % 2 == 0
    s.steps += 1
    send = openai_turn if s.api == "openai" else anthropic_turn
    counted = tally.call(None, lambda: trim(clients["anthropic"], s, max_history))
    reply = counted if counted in (None, HUNG) else tally.call("agent", lambda: send(clients[s.api], s, forced))
    if reply is HUNG:
        s.stopped = True  # a hung connection is the verdict; waiting out every later turn says nothing more
    elif reply is not None:
        tally.history(reply.prompt_tokens)
        s.add(reply)


def run_session(s: Session, clients: dict, tally: Tally, turns: int, max_history: int) -> None:
    while s.steps < turns and not s.stopped:
        session_step(s, clients, tally, max_history)


def short_spec(rng: random.Random) -> dict:
    """A one-line request in bench_serve.one's shape."""
    return {"prompt": f"{rng.choice(QUESTIONS)} ({rng.choice(WORDS)})", "max_tokens": rng.randint(1, 16),
            "stream": rng.random() < 0.5, "api": rng.choice(["openai", "anthropic"]),
            "sampling": {"temperature": 0} if rng.random() < 0.5 else {"temperature": 0.8, "seed": rng.randrange(99)}}


def dist(values_s: list[float]) -> dict:
    """p50 / p95 / max in ms."""
    ms = [v * 1000 for v in values_s]
    return {k: None if (x := pct(ms, q)) is None else round(x, 1) for k, q in (("p50", 0.5), ("p95", 0.95),
                                                                               ("max", 1.0))}


def make_clients(port: int, timeout_s: float) -> dict:
    return {"openai": openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                    timeout=timeout_s),
            "anthropic": anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="unused", max_retries=0,
                                             timeout=timeout_s)}


def log(msg: str) -> None:
    print(f"bench_soak: {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8, help="concurrent agent sessions (phase 1)")
    ap.add_argument("--turns", type=int, default=20, help="requests per agent session")
    ap.add_argument("--short", type=int, default=1000, help="short requests (phase 2)")
    ap.add_argument("--concurrency", type=int, default=8, help="client threads of phase 2")
    ap.add_argument("--max-history", type=int, default=1700, help="tokens an agent request's history may reach")
    ap.add_argument("--keep-outputs", type=int, default=3, help="tool outputs left whole; older ones are elided")
    ap.add_argument("--output-scale", type=int, default=1, help="generated pieces per tool output (~250 tokens each)")
    ap.add_argument("--context", type=int, default=None,
                    help="serve the default model's weights with this declared context (above its 2,048)")
    ap.add_argument("--long", action="store_true",
                    help="the >= 8k-token history profile: --context 16384 --keep-outputs 5 --output-scale 6 "
                         "--max-history 12000")
    ap.add_argument("--max-batch", type=int, default=4, help="the server's --max-batch")
    ap.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, help="the server's --prefill-chunk")
    ap.add_argument("--state-cache", choices=["off", "prefix", "semantic"], default="semantic",
                    help="the server's --state-cache")
    ap.add_argument("--state-cache-mib", type=float, default=256,
                    help="the state cache's budget (half device tier, half host tier): it fills during phase 1, "
                         "so phase 2's RSS growth shows leaks, not a cache filling up")
    ap.add_argument("--timeout", type=float, default=120, help="client-side deadline of a request, s (hung after)")
    ap.add_argument("--startup-timeout", type=float, default=600, help="s to wait for the server's /health")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 sessions x 4 turns, 40 short requests")
    add_allow_dirty_argument(ap)
    a = ap.parse_args(argv)
    check_clean_or_exit(a.allow_dirty)
    if a.long:
        a.context, a.keep_outputs, a.output_scale, a.max_history = 16384, 5, 6, 12000
    if a.quick:
        a.sessions, a.turns, a.short = 2, 4, 40
    port = _free_port()
    with tempfile.TemporaryFile() as server_err, tempfile.TemporaryDirectory() as tmp:
        a.model_dir = default_model_with_context(a.context, Path(tmp) / "model") if a.context else None
        log(f"starting the server on 127.0.0.1:{port} (--warmup, --state-cache {a.state_cache}"
            f"{f', context {a.context}' if a.context else ''})")
        proc = start_server(a, port, server_err)
        try:
            line = soak(a, port, proc)
        finally:
            shutdown_s = stop_server(proc)
        messages = [m for m in server_log(server_err).splitlines()
                    if m.strip() and "compiled the engine's programs" not in m and " on http://" not in m]
    line.update({"server_shutdown_s": shutdown_s, "server_exit_code": proc.returncode,
                 "server_messages": messages[-5:], **commit_info(), **machine_info(), **run_fields()})
    print(json.dumps(line), flush=True)
    return 0 if not line["hung"] and not line["errors"] else 1


def soak(a, port: int, proc: subprocess.Popen) -> dict:
    """Both phases against the running server -> the JSON line's measurements."""
    clients, tally = make_clients(port, a.timeout), Tally(a.timeout)
    rng = random.Random(a.seed)
    sessions = [Session(i, random.Random(f"{a.seed}:{i}"), TASKS[i % len(TASKS)], keep_outputs=a.keep_outputs,
                        output_scale=a.output_scale) for i in range(a.sessions)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, a.sessions)) as pool:
        list(pool.map(lambda s: session_step(s, clients, tally, a.max_history), sessions))  # round 1
        round1 = rss(proc.pid)["rss_mib"]
        log(f"round 1 of {a.sessions} sessions done; server RSS {round1} MiB")
        list(pool.map(lambda s: run_session(s, clients, tally, a.turns, a.max_history), sessions))
    agent_s = time.perf_counter() - t0
    baseline = rss(proc.pid)["rss_mib"]  # every program compiled, the state cache at its budget
    log(f"phase 1: {tally.requests['agent']} agent requests in {agent_s:.1f} s; server RSS {baseline} MiB")
    t0 = time.perf_counter()
    specs = [short_spec(rng) for _ in range(a.short)]
    with ThreadPoolExecutor(max(1, a.concurrency)) as pool:
        list(pool.map(lambda spec: tally.call("short", lambda: one(clients, spec)), specs))
    short_s = time.perf_counter() - t0
    log(f"phase 2: {tally.requests['short']} short requests in {short_s:.1f} s")
    end = rss(proc.pid)["rss_mib"]
    stats = server_stats(port)
    all_lat = tally.latency["agent"] + tally.latency["short"]
    all_ttft = tally.ttft["agent"] + tally.ttft["short"]
    return {"bench": "serve_agent_soak", "model": MODEL, "requests": tally.requests["agent"] + tally.requests["short"],
            "hung": tally.errors["timeout"], "errors": dict(tally.errors), "error_samples": tally.samples,
            "ttft_ms": {"agent": dist(tally.ttft["agent"]), "short": dist(tally.ttft["short"]), "all": dist(all_ttft)},
            "latency_ms": {"agent": dist(tally.latency["agent"]), "short": dist(tally.latency["short"]),
                           "all": dist(all_lat)},
            "phase_wall_s": {"agent": round(agent_s, 1), "short": round(short_s, 1)},
            "rss_mib_round1": round1, "rss_mib_baseline": baseline, "rss_mib_end": end,
            "rss_growth": round(end / baseline - 1, 4), "state_cache_budget_mib": a.state_cache_mib,
            "max_history_tokens": tally.max_history, "turns_dropped": sum(s.dropped_turns for s in sessions),
            "agent_tool_calls": sum(s.tool_calls for s in sessions),
            "sessions_stopped": sum(s.stopped for s in sessions), "count_tokens_requests": tally.requests[
                "count_tokens"], "sessions": a.sessions, "turns": a.turns, "short": a.short,
            "concurrency": a.concurrency, "max_batch": a.max_batch, "prefill_chunk": a.prefill_chunk,
            "max_history": a.max_history,
            "context": a.context or 2048, "keep_outputs": a.keep_outputs, "output_scale": a.output_scale,
            "agent_history_tokens": {k: pct(tally.histories, q)
                                     for k, q in (("min", 0.0), ("p50", 0.5), ("p95", 0.95), ("max", 1.0))},
            "state_cache": a.state_cache, "timeout_s": a.timeout, **stats}


if __name__ == "__main__":
    sys.exit(main())
