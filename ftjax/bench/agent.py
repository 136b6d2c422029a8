"""`ftjax bench agent`: replay multi-turn agent transcripts against `ftjax serve` and
report the tail time-to-first-token per server state-cache mode.

    for mode in off, prefix, semantic:
        python -m ftjax.cli serve --state-cache MODE --max-batch ROWS --warmup   (subprocess, free port)
        one unrecorded warm-up request per SDK
        for workload in coding (OpenAI SDK), assistant (Anthropic SDK):
            for each request of the transcript (ftjax.data.agent_transcripts): stream it, time it
        a thread polls GET /v1/stats (memory split over time, state-cache counters)
        stop the server (SIGINT, then SIGTERM)

The transcripts are scripted (the model's own replies never enter the history) and
rewritten between requests the way agent frameworks do it (old reasoning dropped, old
tool outputs trimmed, a tool call re-serialised), so every mode sees exactly the same
prompts and only the server's reuse of earlier work differs. Requests go through the real
`openai` / `anthropic` clients, greedy, `max_tokens` small: one at a time, or, with
`agents` > 1, from that many concurrent sessions of each workload (each its own thread and
system prompt, `Workload.for_session`), which with more sessions than serve's rows
(`max_batch`) and no tool time keeps every row busy: the load case.

What is measured, client side, per request:
    TTFT     time.perf_counter() from just before the SDK call to the arrival of the first
             streamed event that carries output: an OpenAI chunk whose delta has non-empty
             `content`, `reasoning_content` or `tool_calls` (the leading role chunk, sent
             before the prefill, does not count), or an Anthropic `content_block_start`. A
             reply without any output (end of sequence at once) falls back to its finish
             event (finish_reason chunk / message_delta); `ttft_event` says which.
    total    request start to the end of the stream.
    tokens   prompt tokens and cached (reused) prompt tokens as the server reports them:
             `usage.prompt_tokens_details.cached_tokens` (OpenAI) or
             `usage.cache_read_input_tokens` (Anthropic, whose `input_tokens` counts only the
             tokens prefilled: prompt = input + cache_read + cache_creation; the final split
             of a stream is in message_delta); None when the server does not report them.
             prefilled = prompt - reused.
Per workload x mode: TTFT p50 / p95 / max over the requests (numpy linear percentiles:
with ~11 requests, p95 sits between the two slowest), tokens prefilled vs reused.

Files in the output folder: agent.json (every record, the stats samples, the summary,
commit and machine), ttft.png (TTFT per request, a panel per workload), memory.png
(the `memory_split` byte fields of /v1/stats over time, present when serve has a
`--device-memory-gb` budget; otherwise the server's RSS and the state cache's bytes),
agent.md (the table and verdicts; CANNOT TEST where nothing was measured),
server-MODE.log. A mode the server does not support (no `--state-cache` in
`serve --help`; `off` then runs without the flag) is skipped with the reason. Progress
goes to stderr; the last stdout line is one JSON summary.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ftjax.bench.plots import pyplot
from ftjax.data import agent_transcripts as transcripts
from ftjax.engine.state_cache import MODES as STATE_CACHE_MODES
from ftjax.runinfo import REPO, commit_info, machine_info

MODES = STATE_CACHE_MODES + ("reprefill",)  # off, prefix, semantic; reprefill = semantic + idle re-prefill
GREEDY = {"temperature": 0}  # as extra_body for the anthropic SDK, whose create() has no temperature parameter


@dataclass
class AgentSettings:
    modes: tuple[str, ...] = MODES
    workloads: tuple[str, ...] = tuple(transcripts.names())
    turns: int | None = None  # requests per workload (None: the whole transcript)
    scale: float = 1.0  # transcript size multiplier (1: fits the embedded model's 2048 tokens)
    max_tokens: int = 16
    model: str | None = None  # None: the embedded model
    port: int = 0  # 0: a free port per mode
    timeout_s: float = 300.0  # server start-up, and each request
    warmup: bool = True  # serve --warmup: compile every program before listening
    max_batch: int = 1  # serve --max-batch: rows decoding at once
    agents: int = 1  # concurrent sessions per workload (1: one request at a time)
    device_memory_gb: float | None = None  # serve --device-memory-gb (a budget: /v1/stats then has memory_split)
    serve_args: tuple[str, ...] = ()  # more serve options, as they are (e.g. --policy host --max-seq-len 8192)
    stats_interval_s: float = 0.5
    history: str = "rewritten"  # "rewritten" (as agent frameworks send it) | "append" (never rewritten)
    #                             | "keep-last-K" (every tool output but the last K replaced by a placeholder)
    tool_time_s: float = 0.0  # the agent's tool runs this long between a response and its next request
    idle_flag: bool = False  # serve has --idle-reprefill (set by run_agent from `serve --help`)

    @classmethod
    def quick(cls, **kw) -> "AgentSettings":
        return cls(**{"turns": 3, "scale": 0.5, "max_tokens": 8, **kw})


# ---- the server ----------------------------------------------------------------------------------

def serve_help() -> str:
    out = subprocess.run([sys.executable, "-m", "ftjax.cli", "serve", "--help"], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"}, timeout=120)
    return out.stdout + out.stderr


def mode_support(modes, help_text: str) -> dict[str, str | None]:
    """mode -> None when it can run, else the reason it cannot (`off` runs without the flag)."""
    if "--state-cache" not in help_text:
        return {m: None if m == "off" else "serve has no --state-cache option in this checkout" for m in modes}
    choices = re.search(r"--state-cache \{([^}]*)\}", help_text)
    known = choices.group(1).split(",") if choices else modes
    if "--idle-reprefill" in help_text:
        known = known + ["reprefill"]
    return {m: None if m in known else f"serve --state-cache has no mode {m!r} (only {', '.join(known)})"
            for m in modes}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(port: int, path: str, timeout: float = 10.0):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """`python -m ftjax.cli serve` in a subprocess, its output in a log file."""

    def __init__(self, s: AgentSettings, mode: str, flag: bool, port: int, log_path: Path):
        self.port, self.log_path = port, log_path
        self.cmd = [sys.executable, "-m", "ftjax.cli", "serve", "--port", str(port), "--max-batch", str(s.max_batch)]
        if s.model:
            self.cmd += ["--model", str(Path(s.model).resolve())]  # the server runs in the repository
        if s.warmup:
            self.cmd.append("--warmup")
        if s.device_memory_gb is not None:
            self.cmd += ["--device-memory-gb", str(s.device_memory_gb)]
        if flag:  # reprefill: the semantic cache with idle re-prefill; the other modes without it
            self.cmd += ["--state-cache", "semantic" if mode == "reprefill" else mode]
        if s.idle_flag:
            self.cmd += ["--idle-reprefill", "on" if mode == "reprefill" else "off"]
        self.cmd += list(s.serve_args)
        self.timeout_s = s.timeout_s

    def start(self) -> float:
        """Start it and wait for /health -> seconds it took."""
        t0 = time.perf_counter()
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        while time.perf_counter() - t0 < self.timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with status {self.proc.returncode}: {self.last_line()}")
            try:
                if get_json(self.port, "/health", 2.0).get("status") == "ok":
                    return time.perf_counter() - t0
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready after {self.timeout_s:.0f} s: {self.last_line()}")

    def stop(self) -> int | None:
        """SIGINT (uvicorn's clean shutdown), then SIGTERM, then SIGKILL."""
        if getattr(self, "proc", None) is None:
            return None
        for sig, wait in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            self.proc.send_signal(sig)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        self.log.close()
        return self.proc.returncode

    def log_tail(self, n: int = 3000) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def last_line(self) -> str:
        """The log's last non-empty line (a traceback's exception), the whole tail in agent.json."""
        lines = [line for line in self.log_tail().splitlines() if line.strip()]
        return lines[-1].strip() if lines else "(no output)"


class StatsPoller(threading.Thread):
    """GET /v1/stats every `interval` s: memory split (or RSS) and state-cache counters."""

    def __init__(self, port: int, interval: float, t0: float):
        super().__init__(daemon=True)
        self.port, self.interval, self.t0 = port, interval, t0
        self.samples: list[dict] = []
        self.workload: str | None = None
        self.halt = threading.Event()

    def sample(self) -> dict | None:
        try:
            stats = get_json(self.port, "/v1/stats", 10.0)
        except (OSError, ValueError):
            return None
        split = stats.get("memory_split")
        s = {"t_s": round(time.perf_counter() - self.t0, 3), "workload": self.workload,
             "memory_split": {k: v for k, v in split.items() if _number(v)} if isinstance(split, dict) else None,
             "memory": stats.get("memory"), "state_cache": stats.get("state_cache"),
             "idle_reprefill": stats.get("idle_reprefill") and {**stats["idle_reprefill"],
                                                                **stats["sessions"].get("idle", {})}}
        self.samples.append(s)
        return s

    def run(self) -> None:
        while not self.halt.is_set():
            self.sample()
            self.halt.wait(self.interval)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ---- one request -----------------------------------------------------------------------------------

@dataclass
class Record:
    mode: str
    workload: str
    api: str
    turn: int  # request index in the transcript, from 0
    messages: int
    agent: int = 0  # the session that sent it (`AgentSettings.agents`)
    ttft_s: float | None = None
    ttft_event: str | None = None  # "output" | "finish" (no output at all)
    total_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    output_chars: int = 0
    state_cache: dict | None = None  # /v1/stats "state_cache" after the request
    error: str | None = None


def stream_openai(client, model_id: str, messages: list[dict], tools: list[dict], max_tokens: int, rec: Record):
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=model_id, messages=messages, tools=tools, max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        now = time.perf_counter() - t0
        if chunk.usage is not None:
            rec.prompt_tokens, rec.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            rec.cached_tokens = details.cached_tokens if details is not None else None
        for c in chunk.choices:
            d = c.delta
            out = (d.content or "") + (getattr(d, "reasoning_content", None) or "")
            rec.output_chars += len(out)
            if rec.ttft_s is None and (out or d.tool_calls):
                rec.ttft_s, rec.ttft_event = now, "output"
            if rec.ttft_s is None and c.finish_reason:
                rec.ttft_s, rec.ttft_event = now, "finish"
    rec.total_s = time.perf_counter() - t0


def stream_anthropic(client, model_id: str, messages: list[dict], tools: list[dict], max_tokens: int, rec: Record):
    system, msgs = transcripts.to_anthropic(messages)
    kw = {"system": system} if system else {}
    t0 = time.perf_counter()
    stream = client.messages.create(model=model_id, messages=msgs, tools=transcripts.anthropic_tools(tools),
                                    max_tokens=max_tokens, stream=True, extra_body=GREEDY, **kw)
    for event in stream:
        now = time.perf_counter() - t0
        if event.type == "message_start":
            rec.prompt_tokens, rec.cached_tokens = anthropic_tokens(event.message.usage)
        elif event.type == "content_block_start" and rec.ttft_s is None:
            rec.ttft_s, rec.ttft_event = now, "output"
        elif event.type == "content_block_delta":
            rec.output_chars += len(getattr(event.delta, "text", None) or getattr(event.delta, "thinking", None) or "")
        elif event.type == "message_delta":
            rec.completion_tokens = event.usage.output_tokens
            if getattr(event.usage, "input_tokens", None) is not None:  # the final split, when the server sends it
                rec.prompt_tokens, rec.cached_tokens = anthropic_tokens(event.usage)
            if rec.ttft_s is None:
                rec.ttft_s, rec.ttft_event = now, "finish"
    rec.total_s = time.perf_counter() - t0


def anthropic_tokens(usage) -> tuple[int, int | None]:
    """(prompt tokens, cached tokens) from Anthropic usage, where input_tokens counts only
    the tokens prefilled: prompt = input + cache_read + cache_creation."""
    read = getattr(usage, "cache_read_input_tokens", None)
    created = getattr(usage, "cache_creation_input_tokens", None) or 0
    return usage.input_tokens + (read or 0) + created, read


def clients(port: int, timeout_s: float) -> dict:
    import anthropic
    import openai

    return {"openai": openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                    timeout=timeout_s),
            "anthropic": anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="unused", max_retries=0,
                                             timeout=timeout_s)}


STREAM = {"openai": stream_openai, "anthropic": stream_anthropic}


def warm_clients(sdk: dict, model_id: str) -> None:
    """One tiny unrecorded request per SDK (connection set-up, first-request paths)."""
    sdk["openai"].chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hello."}],
                                          max_tokens=2, temperature=0)
    sdk["anthropic"].messages.create(model=model_id, messages=[{"role": "user", "content": "Hello."}], max_tokens=2,
                                     extra_body=GREEDY)


# ---- one mode ----------------------------------------------------------------------------------------

def history(w, style: str):
    """The workload as an agent with this history style sends it."""
    if style == "append":
        return w.append_only()
    if style.startswith("keep-last-"):
        return w.keep_last_tool_outputs(int(style.removeprefix("keep-last-")))
    if style != "rewritten":
        raise ValueError(f"history must be rewritten, append or keep-last-K, got {style!r}")
    return w


def run_mode(s: AgentSettings, mode: str, flag: bool, out: Path, log: Callable[[str], None]) -> tuple[dict, list]:
    """Start the server in `mode`, replay every workload, stop it -> (mode info, records)."""
    port = s.port or free_port()
    server = Server(s, mode, flag, port, out / f"server-{mode}.log")
    info = {"status": "ok", "cmd": " ".join(server.cmd[1:]), "port": port}
    records: list[Record] = []
    t0 = time.perf_counter()
    poller = None
    try:
        info["startup_s"] = round(server.start(), 2)
        log(f"{mode}: server ready on port {port} in {info['startup_s']:.1f} s")
        model = get_json(port, "/v1/models")["data"][0]
        model_id, info["context"] = model["id"], model.get("context_length")
        sdk = clients(port, s.timeout_s)
        warm_clients(sdk, model_id)
        poller = StatsPoller(port, s.stats_interval_s, t0)
        poller.start()
        before = poller.sample()
        for name in s.workloads:
            poller.workload = name
            failed: list[BaseException] = []
            first_end = threading.Lock()  # the first session to end samples the idle counters
            start = poller.sample()

            def session(k: int) -> None:
                try:
                    replay(s, mode, name, k, sdk, model_id, poller, records, log)
                except BaseException as e:  # noqa: BLE001 - raised again below, in this thread
                    failed.append(e)
                if s.agents > 1 and first_end.acquire(blocking=False):
                    info.setdefault("idle_work_all_sessions", {})[name] = idle_work(start, poller.sample())

            sessions = [threading.Thread(target=session, args=(k,), name=f"agent-{name}-{k}") for k in range(s.agents)]
            for t in sessions:
                t.start()
            for t in sessions:
                t.join()
            if failed:
                raise failed[0]
        info["idle_work"] = idle_work(before, poller.sample())
    except Exception as e:
        info["status"], info["reason"] = "error", f"{type(e).__name__}: {e}"[:500]
        info["log_tail"] = server.log_tail() if server.log_path.exists() else None
        log(f"!! {mode}: {info['reason']} (log: {server.log_path})")
    finally:
        if poller is not None:
            poller.halt.set()
            poller.join(5)
            info["final_stats"] = poller.sample()
        info["exit_status"] = server.stop()
        info["samples"] = poller.samples if poller is not None else []
        info["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return info, records


IDLE_COUNTERS = ("admitted", "done", "preempted", "dropped", "tokens")


def idle_work(before: dict | None, after: dict | None) -> dict | None:
    """The idle re-prefill work the server did between two /v1/stats samples (the replay,
    warm-up excluded): jobs admitted, finished, preempted, dropped and tokens prefilled;
    None when idle re-prefill is off."""
    a, b = (x and x.get("idle_reprefill") for x in (after, before))
    if not a or not b:
        return None
    return {k: a[k] - b[k] for k in IDLE_COUNTERS}


def replay(s: AgentSettings, mode: str, name: str, agent: int, sdk: dict, model_id: str, poller: StatsPoller,
           records: list, log: Callable[[str], None]) -> None:
    """One agent session: every request of workload `name`, in order, into `records`."""
    w = history(transcripts.build(name, s.scale).for_session(agent), s.history)
    requests = w.requests()[: s.turns]
    who = f"{mode}/{name}" + (f"/{agent}" if s.agents > 1 else "")
    for i, messages in enumerate(requests):
        rec = Record(mode, name, w.api, i, len(messages), agent)
        try:
            STREAM[w.api](sdk[w.api], model_id, messages, w.tools, s.max_tokens, rec)
        except Exception as e:  # recorded; the next request still runs
            rec.error = f"{type(e).__name__}: {e}"[:500]
        if rec.error is None and rec.ttft_s is None:
            rec.error = "the stream ended without output or a finish event"
        after = poller.sample()
        rec.state_cache = after and after["state_cache"]
        records.append(rec)
        if s.tool_time_s and i + 1 < len(requests):
            time.sleep(s.tool_time_s)  # the agent's tool runs: the engine is idle
        log(f"{who} {i + 1}/{len(requests)}: " + (
            f"ERROR {rec.error}" if rec.error else
            f"{rec.prompt_tokens} prompt tokens, cached {rec.cached_tokens}, TTFT {rec.ttft_s * 1e3:.0f} ms"
            f" ({rec.ttft_event}), total {rec.total_s * 1e3:.0f} ms"))


# ---- summary ------------------------------------------------------------------------------------------

def summarize(records: list[dict], workload: str, mode: str) -> dict:
    rows = [r for r in records if r["workload"] == workload and r["mode"] == mode]
    ok = [r for r in rows if r["error"] is None and r["ttft_s"] is not None]
    out = {"workload": workload, "mode": mode, "requests": len(rows), "ok": len(ok), "errors": len(rows) - len(ok)}
    if not ok:
        return out
    ttft = np.array([r["ttft_s"] for r in ok])
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    reported = all(r["cached_tokens"] is not None for r in ok)
    reused = sum(r["cached_tokens"] for r in ok) if reported else None
    out.update(ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p95_s=float(np.percentile(ttft, 95)),
               ttft_max_s=float(ttft.max()), ttft_mean_s=float(ttft.mean()),
               total_p50_s=float(np.median([r["total_s"] for r in ok])), prompt_tokens=prompt,
               reused_tokens=reused, prefilled_tokens=prompt - (reused or 0), reuse_reported=reported,
               no_output_requests=sum(r["ttft_event"] == "finish" for r in ok))
    return out


def verdicts(summary: list[dict], workloads, modes) -> list[str]:
    """One line per workload and non-off mode: p50 / p95 ratios against off; and
    reprefill against semantic (the same cache, idle re-prefill the only difference)
    when both ran."""
    cell = {(r["workload"], r["mode"]): r for r in summary if r.get("ttft_p95_s")}
    pairs = [(m, "off") for m in modes if m != "off" and "off" in modes]
    if "reprefill" in modes and "semantic" in modes:
        pairs.append(("reprefill", "semantic"))
    if not pairs:
        return ["only one mode (or no off) was run: no comparison"]
    lines = []
    for w in workloads:
        for m, ref in pairs:
            base, new = cell.get((w, ref)), cell.get((w, m))
            if base is None or new is None:
                missing = " and ".join(x for x, c in ((ref, base), (m, new)) if c is None)
                lines.append(f"{w}: {m} vs {ref}: CANNOT TEST ({missing} not measured)")
                continue
            parts = []
            for q in ("p50", "p95"):
                ratio = base[f"ttft_{q}_s"] / new[f"ttft_{q}_s"]
                parts.append(f"{q} {ratio:.2f}x lower" if ratio >= 1 else f"{q} {1 / ratio:.2f}x higher")
            lines.append(f"{w}: {m} vs {ref}: " + ", ".join(parts))
    return lines


# ---- outputs --------------------------------------------------------------------------------------------

def ttft_figure(records: list[dict], workloads, modes, path: Path) -> None:
    """TTFT per request, one line per mode; prompt tokens as grey bars behind."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(workloads), figsize=(6.0 * len(workloads), 4.2), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        rows = [r for r in records if r["workload"] == w]
        prompt = {}
        for r in rows:
            if r["prompt_tokens"]:
                prompt.setdefault(r["turn"], r["prompt_tokens"])
        if prompt:
            tw = ax.twinx()
            tw.bar([t + 1 for t in prompt], list(prompt.values()), color="0.85", width=0.6, zorder=0)
            tw.set_ylabel("prompt tokens", color="0.5")
            ax.set_zorder(tw.get_zorder() + 1)
            ax.patch.set_visible(False)
        for m in modes:  # the median over concurrent sessions (`agents`) at each turn
            by_turn: dict[int, list[float]] = {}
            for r in rows:
                if r["mode"] == m and r["ttft_s"] is not None:
                    by_turn.setdefault(r["turn"] + 1, []).append(r["ttft_s"] * 1e3)
            if by_turn:
                turns = sorted(by_turn)
                ax.plot(turns, [float(np.median(by_turn[t])) for t in turns], marker="o", label=m)
        ax.set(xlabel="request (turn)", ylabel="TTFT, ms", title=f"{w}: time to first token")
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory_series(samples: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """field -> [(t, MiB)]: every *_bytes field of memory_split (serve with a device memory
    budget), else the server's RSS; and the state cache's bytes per tier unless the split
    has a state_cache_bytes field."""
    series: dict[str, list] = {}
    for s in sorted(samples, key=lambda s: s["t_s"]):
        fields = {k: v for k, v in (s.get("memory_split") or {}).items() if k.endswith("_bytes")}
        if not fields and (s.get("memory") or {}).get("rss_bytes") is not None:
            fields["rss_bytes"] = s["memory"]["rss_bytes"]
        if "state_cache_bytes" not in fields:
            tiers = (s.get("state_cache") or {}).get("bytes") or {}
            fields.update({f"state_cache_{t}_bytes": v for t, v in tiers.items() if _number(v)})
        for k, v in fields.items():
            series.setdefault(k, []).append((s["t_s"], v / 2**20))
    return series


def memory_figure(modes_info: dict, path: Path) -> None:
    plt = pyplot()
    modes = [m for m, i in modes_info.items() if i.get("samples")]
    fig, axes = plt.subplots(1, max(1, len(modes)), figsize=(6.0 * max(1, len(modes)), 4.2), squeeze=False)
    for ax, m in zip(axes[0], modes):
        samples = modes_info[m]["samples"]
        for k, pts in memory_series(samples).items():
            ax.plot(*zip(*pts), label=k.removesuffix("_bytes"))
        starts = {}
        for s in samples:
            if s["workload"] is not None:
                starts.setdefault(s["workload"], s["t_s"])
        for w, t in starts.items():
            ax.axvline(t, color="0.6", ls="--", lw=0.8)
            ax.annotate(w, (t, 1.0), xycoords=("data", "axes fraction"), fontsize=7, va="top", rotation=90)
        ax.set(xlabel="seconds since server start", ylabel="MiB", title=f"memory, state cache {m}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if not modes:
        axes[0][0].text(0.5, 0.5, "no /v1/stats samples", ha="center", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def write_markdown(doc: dict, path: Path) -> None:
    s = doc["settings"]
    lines = ["# ftjax bench agent: tail TTFT of agent replay per state-cache mode", "",
             f"commit {doc['commit']['commit']}{' (dirty)' if doc['commit']['dirty'] else ''}; "
             f"{doc['machine']['cpu']}, {doc['machine']['cores_used']} cores, load {doc['machine']['loadavg_1m']:.2f}; "
             f"model {s['model'] or 'embedded default'}; scale {s['scale']}, max_tokens {s['max_tokens']}, "
             f"turns {s['turns'] or 'all'}; {s.get('agents', 1)} concurrent session(s) per workload, "
             f"max_batch {s['max_batch']}.", "",
             "TTFT: client-side, request sent -> first streamed event with output (see `ftjax/bench/agent.py`).",
             "Tokens are summed over the workload's requests; reused = cached prompt tokens the server reports.", "",
             "| workload | mode | requests ok | TTFT p50 ms | TTFT p95 ms | TTFT max ms | prompt tokens "
             "| prefilled | reused |", "|---|---|---|---|---|---|---|---|---|"]
    cell = {(r["workload"], r["mode"]): r for r in doc["summary"]}
    for w in s["workloads"]:
        for m in s["modes"]:
            info = doc["modes"].get(m, {})
            r = cell.get((w, m))
            if info.get("status") != "ok" or r is None or not r.get("ok"):
                why = info.get("reason") or (f"{r['errors']} requests failed" if r else "not run")
                why = " ".join(why.split()).replace("|", "/")[:160]
                lines.append(f"| {w} | {m} | CANNOT TEST: {why} | | | | | | |")
                continue
            reused = r["reused_tokens"] if r["reuse_reported"] else "not reported"
            lines.append(f"| {w} | {m} | {r['ok']}/{r['requests']} | {_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p95_s'])} "
                         f"| {_ms(r['ttft_max_s'])} | {r['prompt_tokens']} | {r['prefilled_tokens']} | {reused} |")
    lines += ["", "Verdicts (TTFT ratios against off, measured here):", ""] + [f"- {v}" for v in doc["verdicts"]]
    counters = [(m, (i.get("final_stats") or {}).get("state_cache")) for m, i in doc["modes"].items()]
    counters = [(m, c) for m, c in counters if c and len(c) > 1]
    if counters:
        lines += ["", "Server state cache at the end of each mode (/v1/stats, warm-up requests included):", ""]
        lines += [f"- {m}: " + ", ".join(f"{k} {v}" for k, v in c.items() if _number(v)) for m, c in counters]
    lines += ["", "Files: agent.json (every request), ttft.png, memory.png, server-MODE.log.", ""]
    path.write_text("\n".join(lines))


def run_agent(out: str | Path, settings: AgentSettings | None = None, log: Callable[[str], None] | None = None,
              help_text: str | None = None) -> dict:
    """Replay every workload in every mode into `out` -> the summary line's dict."""
    t0 = time.perf_counter()
    s = settings or AgentSettings()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log = log or (lambda m: print(f"[{time.perf_counter() - t0:7.1f}s] {m}", file=sys.stderr, flush=True))
    help_text = serve_help() if help_text is None else help_text
    support = mode_support(s.modes, help_text)
    flag = "--state-cache" in help_text
    s.idle_flag = "--idle-reprefill" in help_text
    doc = {"commit": commit_info(), "machine": machine_info(), "settings": asdict(s),
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "state_cache_flag": flag, "modes": {}, "records": []}
    for mode in s.modes:
        if support[mode]:
            doc["modes"][mode] = {"status": "skipped", "reason": support[mode]}
            log(f"{mode}: skipped ({support[mode]})")
            continue
        info, records = run_mode(s, mode, flag, out, log)
        doc["modes"][mode] = info
        doc["records"] += [asdict(r) for r in records]
    doc["summary"] = [summarize(doc["records"], w, m) for w in s.workloads for m in s.modes]
    doc["verdicts"] = verdicts(doc["summary"], s.workloads, s.modes)
    doc["elapsed_s"] = round(time.perf_counter() - t0, 1)
    (out / "agent.json").write_text(json.dumps(doc, indent=1) + "\n")
    ttft_figure(doc["records"], s.workloads, s.modes, out / "ttft.png")
    memory_figure(doc["modes"], out / "memory.png")
    write_markdown(doc, out / "agent.md")
    return summary_line(doc, out)


def summary_line(doc: dict, out: str | Path) -> dict:
    """The one JSON line of a run, from its agent.json document (the run's own commit,
    machine and start time)."""
    s = doc["settings"]
    errors = sum(r["error"] is not None for r in doc["records"])
    errors += sum(i["status"] == "error" for i in doc["modes"].values())
    return {"bench": "agent", "out": str(out), **doc["commit"], "machine": doc["machine"], "time": doc["started"],
            "model": s["model"] or "default", "history": s.get("history", "rewritten"), "elapsed_s": doc["elapsed_s"],
            "tool_time_s": s.get("tool_time_s", 0.0), "scale": s.get("scale"), "agents": s.get("agents", 1),
            "max_batch": s.get("max_batch", 1),
            "idle_reprefill": ((doc["modes"].get("reprefill") or {}).get("final_stats") or {}).get("idle_reprefill"),
            "modes": {m: i["status"] for m, i in doc["modes"].items()},
            "idle_work": {m: i["idle_work"] for m, i in doc["modes"].items() if i.get("idle_work") is not None},
            # with agents > 1: the idle work done before the first session ended, every session
            # still sending (the load case), per workload
            "idle_work_all_sessions": {m: i["idle_work_all_sessions"] for m, i in doc["modes"].items()
                                       if i.get("idle_work_all_sessions")},
            "ttft_ms": {f"{r['workload']}/{r['mode']}": {q: round(r[f"ttft_{q}_s"] * 1e3, 1)
                                                         for q in ("p50", "p95", "max")}
                        for r in doc["summary"] if r.get("ok")},
            "prompt_tokens": {f"{r['workload']}/{r['mode']}": {"prefilled": r["prefilled_tokens"],
                                                                "reused": r["reused_tokens"]}
                              for r in doc["summary"] if r.get("ok") and r.get("reuse_reported")},
            "verdicts": doc["verdicts"], "errors": errors}
