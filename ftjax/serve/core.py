"""The protocol-neutral core of `ftjax serve`: a request becomes a token stream, the
token stream becomes reasoning, text and tool calls.

    ChatRequest (messages, tools, tool_choice, max_tokens, sampling, stop)
      ─► Engine.prepare: chat template (tools rendered) -> prompt ids, checked against
         the context; tool_choice -> forced / banned tokens
      ─► Engine.start -> Generation: a scheduler Job (engine/scheduler.py, the engine
         thread) whose tokens go through an OutputParser on that thread
      ─► events on an asyncio queue: Delta("reasoning" | "text", str), ToolCall, Done

The OpenAI and Anthropic adapters only translate to and from these types.

Output parsing is token-level: the template's tags (`<think>`, `</think>`,
`<tool_call>`, `</tool_call>`) are single added tokens, so a tag is never split across
pieces. Text between tags streams through a `StreamDecoder`; each segment is stripped
of the newlines the template puts around it, and held back where it could be the start
of a stop string. A tool-call block is parsed when it closes: JSON with a "name" and an
object "arguments"; a block that does not parse is returned as text, never guessed.

tool_choice is enforced by the decoder, not by hoping: "none" bans the `<tool_call>`
token; a named tool (or "required" with one tool) forces `<tool_call>\\n{"name":
"NAME", "arguments": ` and the model writes the arguments; "required" with several
tools forces `<tool_call>\\n{"name": "` and the model writes name and arguments.
What the model writes is not grammar-constrained: a block that is not valid JSON comes
back as text (the template's training makes that rare for the default model).

Reasoning can be forced on (`<think>` first) and held to a budget of tokens, after
which `</think>` is forced and the answer follows (budget forcing).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import numpy as np

from ftjax.engine.rewrites import RewriteTracker
from ftjax.engine.scheduler import DEFAULT_MAX_QUEUE, DEFAULT_PREFILL_CHUNK, Job, NotAccepting, QueueFull, Scheduler
from ftjax.engine.session import Sampling

log = logging.getLogger("ftjax.serve")
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_DRAIN_S = 30.0
RETRY_AFTER_S = 1
MIN_IDLE_TOKENS = 16  # a predicted history that a prefix match would reuse but for fewer tokens is not prefilled

TAGS = {"<think>": "think_open", "</think>": "think_close", "<tool_call>": "call_open", "</tool_call>": "call_close"}
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")


class ServeError(Exception):
    """A request the server refuses: HTTP status + a message naming the problem."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error", param: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.message, self.status, self.kind, self.param = message, status, kind, param
        self.retry_after = retry_after  # seconds, sent as Retry-After


# ---- the neutral request and events ------------------------------------------------------

@dataclass
class ChatRequest:
    messages: list[dict] | None  # template messages; None for a raw prompt
    max_tokens: int | None  # None: up to the end of the context (grown as it goes, not reserved)
    sampling: Sampling
    stop: list[str] = field(default_factory=list)
    tools: list[dict] | None = None  # [{"type": "function", "function": {name, description, parameters}}]
    tool_choice: str | dict = "auto"  # "auto" | "none" | "required" | {"name": NAME}
    prompt: str | None = None  # raw text prompt (completions): no template, no parsing
    think: bool = False  # open the reply with <think> (reasoning forced on)
    think_budget: int | None = None  # reasoning tokens after which </think> is forced
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    timeout_s: float | None = None  # this request's deadline (at most the server's)


@dataclass
class Delta:
    kind: str  # "reasoning" | "text"
    text: str


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, serialized


@dataclass
class Done:
    reason: str  # eos | stop | length | context | cancelled | timeout | error: ...
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None
    cached_tokens: int = 0  # prompt tokens the state cache restored (not prefilled)


def new_id() -> str:
    return uuid.uuid4().hex[:24]


def check_tools(tools: list[dict] | None, tool_choice: str | dict) -> None:
    """Tool schemas and tool_choice, normalized to the OpenAI function shape."""
    names = set()
    for i, t in enumerate(tools or []):
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ServeError(f"tools[{i}]: invalid tool name {name!r} (1-64 of a-z, A-Z, 0-9, _ . -)", param="tools")
        if name in names:
            raise ServeError(f"tools[{i}]: duplicate tool name {name!r}", param="tools")
        names.add(name)
        schema = fn.get("parameters")
        if schema is None:
            continue
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise ServeError(f"tools[{i}] ({name}): the parameters schema must be a JSON-schema object with "
                             f"\"type\": \"object\"", param="tools")
        props = schema.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            raise ServeError(f"tools[{i}] ({name}): \"properties\" must map names to schemas", param="tools")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) and r in props for r in required):
            raise ServeError(f"tools[{i}] ({name}): \"required\" must list names from \"properties\"", param="tools")
    if isinstance(tool_choice, dict):
        if tool_choice["name"] not in names:
            raise ServeError(f"tool_choice names {tool_choice['name']!r}, which is not among the tools "
                             f"({', '.join(sorted(names)) or 'none given'})", param="tool_choice")
    elif tool_choice == "required" and not names:
        raise ServeError("tool_choice requires a tool call but no tools were given", param="tool_choice")


# ---- output parsing (engine thread) ---------------------------------------------------------

class _Segment:
    """One run of text or reasoning: strips its edges, holds back possible stop-string starts."""

    def __init__(self, kind: str, stops: list[str], strip: bool = True):
        self.kind, self.stops, self.strip, self.pending, self.started = kind, stops, strip, "", not strip

    def push(self, piece: str) -> tuple[str, str | None]:
        """-> (text safe to emit, the stop string if one was hit)."""
        buf = self.pending + piece
        if not self.started:
            buf = buf.lstrip()
            self.started = bool(buf)
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            i, s = min(hits)
            self.pending = ""
            return (buf[:i].rstrip() if self.strip else buf[:i]), s
        hold = len(buf.rstrip()) if self.strip else len(buf)
        for s in self.stops:
            for j in range(max(0, len(buf) - len(s) + 1), len(buf)):
                if s.startswith(buf[j:]):
                    hold = min(hold, j)
                    break
        self.pending = buf[hold:]
        return buf[:hold], None

    def flush(self) -> str:
        out, self.pending = self.pending.rstrip() if self.strip else self.pending, ""
        return out


class OutputParser:
    """Token ids -> Delta / ToolCall events. `feed` returns (events, stop string or None)."""

    def __init__(self, tokenizer, stops: list[str], structured: bool = True):
        self.tok, self.stops, self.structured = tokenizer, stops, structured
        self.tags = {tokenizer.added_token_ids[t]: kind for t, kind in TAGS.items()
                     if structured and t in tokenizer.added_token_ids}
        self.mode = "text"
        self._new_segment()

    def _new_segment(self) -> None:
        self.decoder = self.tok.stream_decoder()
        self.segment = _Segment("reasoning" if self.mode == "think" else self.mode, self.stops, self.structured)

    def _close_segment(self) -> list:
        rest = self.decoder.flush()
        if self.mode == "call":
            return self._tool_call(self.call_text + rest)
        text, _ = self.segment.push(rest) if rest else ("", None)
        text += self.segment.flush()
        return [Delta(self.segment.kind, text)] if text else []

    def _tool_call(self, text: str) -> list:
        try:
            obj = json.loads(text)
            args = obj["arguments"]
            args = json.loads(args) if isinstance(args, str) else args
            if isinstance(obj["name"], str) and isinstance(args, dict):
                return [ToolCall(new_id(), obj["name"], json.dumps(args, ensure_ascii=False))]
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
        return [Delta("text", f"<tool_call>{text}</tool_call>")]  # not a valid call: shown as it was written

    def feed(self, tok: int) -> tuple[list, str | None]:
        kind = self.tags.get(tok)
        if kind is None:
            piece = self.decoder.push(tok)
            if self.mode == "call":
                self.call_text += piece
                return [], None
            text, stop = self.segment.push(piece) if piece else ("", None)
            return ([Delta(self.segment.kind, text)] if text else []), stop
        if kind == "call_close" and self.mode != "call" or kind == "think_close" and self.mode != "think":
            return [], None  # a stray closing tag: nothing to close
        events = self._close_segment()
        self.mode = {"think_open": "think", "call_open": "call"}.get(kind, "text")
        self.call_text = ""
        self._new_segment()
        return events, None

    def finish(self) -> list:
        if self.mode == "call":  # an unclosed block (length): its text, as written
            return [Delta("text", "<tool_call>" + self.call_text + self.decoder.flush())]
        return self._close_segment()


# ---- one request in flight ------------------------------------------------------------------

class Generation:
    """Bridges a scheduler Job (engine thread) to an asyncio consumer."""

    def __init__(self, engine: Engine, ids: np.ndarray, req: ChatRequest, forced: list[int], banned: frozenset,
                 loop: asyncio.AbstractEventLoop, max_tokens: int, next_prompt: list[int] | None = None):
        self.engine, self.loop, self.prompt_tokens = engine, loop, int(ids.size)
        self.next_prompt = next_prompt  # how the conversation's next request should begin: prefilled when idle
        self.id = new_id()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.parser = OutputParser(engine.tokenizer, req.stop, structured=req.messages is not None)
        self.stop_sequence = None
        self.think_budget, self.think_tokens = req.think_budget, 0
        self.t_start, self.t_first = time.perf_counter(), None
        timeout = min(req.timeout_s or engine.request_timeout_s, engine.request_timeout_s)
        self.job = Job(ids, max_tokens, req.sampling, self._on_token, self._on_done, forced, banned,
                       logit_bias=req.logit_bias, deadline=time.monotonic() + timeout, id=self.id)

    def _put(self, events: list) -> None:
        if events:
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, events)
            except RuntimeError:  # the event loop is gone (server shutting down)
                pass

    def _on_token(self, tok: int) -> bool | list[int]:
        if self.t_first is None:
            self.t_first = time.perf_counter()
        events, stop = self.parser.feed(tok)
        self._put(events)
        self.stop_sequence = stop
        return stop is not None or self._budget_spent(tok)

    def _budget_spent(self, tok: int) -> bool | list[int]:
        """Budget forcing: once the reasoning has its budget of tokens, force `</think>`."""
        if self.parser.mode != "think" or self.think_budget is None or tok in self.parser.tags:
            return False
        self.think_tokens += 1
        if self.think_tokens != self.think_budget:
            return False
        return [self.engine.tokenizer.added_token_ids["</think>"]]

    def _on_done(self, reason: str) -> None:
        if self.next_prompt is not None and reason in ("eos", "stop", "length"):
            self.engine.scheduler.submit_idle(np.asarray(self.next_prompt, np.int32))
        events = self.parser.finish() if not reason.startswith(("error", "timeout")) else []
        self._put(events + [Done(reason, self.prompt_tokens, self.job.new_tokens, self.stop_sequence,
                                 self.job.cached_tokens)])

    def cancel(self) -> None:
        self.engine.scheduler.cancel(self.job)

    async def events(self, keepalive_s: float) -> AsyncIterator[Any]:
        """Events until Done (the last one); None every keepalive_s while nothing comes."""
        while True:
            try:
                batch = await asyncio.wait_for(self.queue.get(), keepalive_s)
            except asyncio.TimeoutError:
                yield None
                continue
            for e in batch:
                yield e
                if isinstance(e, Done):
                    return


@dataclass
class Result:
    reasoning: str = ""
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    done: Done | None = None


async def collect(gen: Generation, disconnected, poll_s: float = 0.25) -> Result:
    """Run a generation to its end (non-streaming); cancel it if the client goes away."""
    out = Result()
    try:
        async for e in gen.events(poll_s):
            if e is None:
                if await disconnected():
                    gen.cancel()
                continue
            if isinstance(e, Delta):
                setattr(out, e.kind, getattr(out, e.kind) + e.text)
            elif isinstance(e, ToolCall):
                out.tool_calls.append(e)
            else:
                out.done = e
    finally:
        if out.done is None:
            gen.cancel()
    failure = done_error(out.done)
    if failure is not None:
        raise failure
    return out


def done_error(done: Done) -> ServeError | None:
    """The error a request that ended this way answers with (None: it succeeded)."""
    if done.reason == "timeout":
        return ServeError("the request did not finish before its deadline (--request-timeout-s)", status=504,
                          kind="timeout_error")
    if done.reason.startswith("error"):
        return ServeError(f"generation failed: {done.reason[len('error: '):]}", status=500, kind="api_error")
    return None


# ---- the engine: model + scheduler thread ------------------------------------------------------

class Engine:
    def __init__(self, model, model_id: str, max_batch: int = 4, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 state_cache=None, max_queue: int = DEFAULT_MAX_QUEUE,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, idle_reprefill: bool = True, replica=None):
        """state_cache: an `engine.state_cache.StateCache` (None: every prompt is prefilled
        whole); the engine owns it from here (its thread uses it; `close` persists it).
        max_queue: requests waiting beyond the running batch (more get 429 / 529);
        request_timeout_s: the longest any request may take, queue included;
        idle_reprefill: learn how each conversation rewrites its history
        (`engine.rewrites`) and, after a response, prefill the predicted beginning of its
        next request into the state cache while the engine is idle (needs a state cache).
        replica: this process's role when several processes run the model
        (`engine.replica`): the leader serves and publishes its decisions, a follower
        runs the same steps (`follow`)."""
        if model.tokenizer is None:
            raise ValueError("ftjax serve needs a model folder with tokenizer.json")
        if not (isinstance(request_timeout_s, (int, float)) and 0 < request_timeout_s < float("inf")):
            raise ValueError(f"request_timeout_s must be a positive number of seconds, got {request_timeout_s!r}")
        self.model, self.model_id, self.tokenizer = model, model_id, model.tokenizer
        self.state_cache = state_cache
        self.request_timeout_s = float(request_timeout_s)
        self.rewrites = RewriteTracker() if idle_reprefill and state_cache is not None else None
        self._rewrites_lock = threading.Lock()  # requests are prepared on worker threads
        self.idle_counters = {"predicted_tokens": 0, "token_exact": 0, "token_wrong": 0, "tokens_ready": 0}
        self.scheduler = Scheduler(model, max_batch, prefill_chunk, state_cache, max_queue, replica)
        self.replica = replica
        self.on_lost = lambda error: None  # called on the engine thread when a peer process is lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftjax-engine", daemon=True)
        self._drain_timer: threading.Timer | None = None
        self.started_at = time.time()

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        self.scheduler.run(self._stop)
        if self.scheduler.lost is not None:
            self.on_lost(self.scheduler.lost)

    def settings(self, **extra) -> dict:
        """What every process of a replicated engine must agree on (`engine.replica`)."""
        m, cache = self.model, self.state_cache
        return {"model": m.fingerprint, "policy": m.policy, "max_seq_len": m.max_seq_len, "numerics": m.numerics,
                "cache_slots": m.cache_slots, "max_batch": self.scheduler.max_batch,
                "prefill_chunk": self.scheduler.prefill_chunk,
                "state_cache": None if cache is None else [cache.mode, cache.budget["device"], cache.budget["host"]],
                **extra}

    def follow(self) -> None:
        """A follower process: run the leader's steps until it stops (`engine.replica`)."""
        try:
            self.replica.follow(self.scheduler)
        finally:
            self.close()

    def health(self) -> dict:
        sch = self.scheduler
        status = "degraded" if sch.degraded else "draining" if not sch.accepting else "ok"
        return {"status": status, "model": self.model_id, **({"reason": sch.degraded} if sch.degraded else {})}

    def shutdown(self, drain_s: float = DEFAULT_DRAIN_S) -> None:
        """Stop admitting (new requests get 503); what is queued or running may finish
        for `drain_s` seconds, then every request still pending ends with an error."""
        if self._drain_timer is not None:
            return
        self.scheduler.drain()
        log.info("shutting down: %d request(s) pending, %.0f s to finish", self.scheduler.pending(), drain_s)
        reason = f"error: ServerShutdown: the server shut down before the request finished (drain of {drain_s:g} s)"
        self._drain_timer = threading.Timer(drain_s, self.scheduler.fail_pending, args=(reason,))
        self._drain_timer.daemon = True
        self._drain_timer.start()

    def close(self) -> None:
        """End what is pending, stop the engine thread, then persist the state cache (once;
        idempotent)."""
        self.scheduler.drain()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        if not self._thread.is_alive():
            self.scheduler.fail_pending("error: ServerShutdown: the server stopped before the request finished")
        if self.scheduler.leading and self.scheduler.lost is None:
            self.replica.stop()  # the followers' steps end here too
        if self.state_cache is not None and not self._thread.is_alive():
            cache, self.state_cache = self.state_cache, None
            cache.close()  # the disk tier (if any) keeps the sessions for the next start

    @property
    def context(self) -> int:
        return self.model.max_seq_len

    def check_model(self, name: str) -> None:
        if name != self.model_id:
            raise ServeError(f"model {name!r} does not exist: this server serves {self.model_id!r}", status=404,
                             kind="not_found_error", param="model")

    def render(self, req: ChatRequest) -> list[int]:
        """The prompt ids: the chat template with the tools, or the raw prompt."""
        if req.messages is None:
            return self.tokenizer.encode(req.prompt)
        try:
            text = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tools=req.tools)
        except Exception as e:  # jinja2 errors and malformed messages: the request's fault
            raise ServeError(f"cannot render the chat template: {e}") from None
        return self.tokenizer.encode(text)

    def _tag(self, tag: str, option: str) -> int:
        tok = self.tokenizer.added_token_ids.get(tag)
        if tok is None:
            raise ServeError(f"{option} is not supported: this model's tokenizer has no {tag} token", param=option)
        return tok

    def _controls(self, req: ChatRequest) -> tuple[list[int], frozenset]:
        """tool_choice and thinking -> (forced first tokens, banned tokens)."""
        choice = req.tool_choice if req.tools else "auto"
        if choice == "auto":
            return ([self._tag("<think>", "thinking")] if req.think else []), frozenset()
        call = self._tag("<tool_call>", "tool_choice")
        if choice == "none":
            return [], frozenset([call])
        if choice == "required" and len(req.tools) > 1:  # the model writes the name
            return [call] + self.tokenizer.encode('\n{"name": "'), frozenset()
        name = choice["name"] if isinstance(choice, dict) else req.tools[0]["function"]["name"]
        return [call] + self.tokenizer.encode(f'\n{{"name": {json.dumps(name)}, "arguments": '), frozenset()

    def prepare(self, req: ChatRequest) -> tuple[np.ndarray, list[int], frozenset, int, list[int] | None]:
        """-> (prompt ids, forced tokens, banned tokens, max new tokens, the predicted
        beginning of the conversation's next request or None). Renders the template:
        call it off the event loop."""
        if req.max_tokens is not None and (not isinstance(req.max_tokens, int) or req.max_tokens < 1):
            raise ServeError(f"max_tokens must be at least 1, got {req.max_tokens}", param="max_tokens")
        if req.max_tokens is not None and req.max_tokens > self.context:
            raise ServeError(f"max_tokens {req.max_tokens} is above the context of {self.context} tokens",
                             param="max_tokens")
        vocab = self.model.config.vocab_size
        bad = [t for t in req.logit_bias if not 0 <= t < vocab]
        if bad:
            raise ServeError(f"logit_bias: token id {bad[0]} is not in this model's vocabulary (0..{vocab - 1})",
                             param="logit_bias")
        ids = self.render(req)
        if not ids:
            raise ServeError("the prompt is empty", param="prompt")
        if len(ids) >= self.context:
            raise ServeError(f"prompt of {len(ids)} tokens does not fit the context of {self.context} tokens "
                             f"(leave room for at least one new token)", param="messages")
        forced, banned = self._controls(req)
        max_tokens = req.max_tokens or self.context - len(ids)
        memory = self.model.memory
        if memory is not None:  # a request that cannot fit even alone, with no expert cached, is refused here
            asked = len(ids) + (req.max_tokens or 1)  # an explicit max_tokens must fit; the default grows
            need = memory.state_bytes(self.scheduler._capacity(asked))
            if need > memory.room_alone():
                raise ServeError(f"prompt of {len(ids)} tokens + max_tokens {req.max_tokens or 1} needs a state of "
                                 f"{need / 2**20:.1f} MiB, more than the device memory budget leaves "
                                 f"({memory.room_alone() / 2**20:.1f} MiB after weights and prefill scratch)",
                                 param="max_tokens")
        checked = self.model.check_ids(ids)
        return checked, forced, banned, max_tokens, self._next_prompt(req, ids)

    def _next_prompt(self, req: ChatRequest, ids: list[int]) -> list[int] | None:
        """Idle re-prefill: check the conversation's last prediction against this
        request's tokens, learn from its messages, and -> the predicted beginning of the
        next request as tokens (None: no rewrite predicted, not confident, or nothing a
        prefix match would not already reuse)."""
        if self.rewrites is None or req.messages is None:
            return None
        with self._rewrites_lock:
            known = self.rewrites.peek(req.messages)
            before = known.predicted_ids if known is not None else None
            if before is not None:
                exact = list(ids[:len(before)]) == before
                self.idle_counters["token_exact" if exact else "token_wrong"] += 1
                self.idle_counters["tokens_ready"] += len(before) if exact else 0
            conv, predicted = self.rewrites.observe(req.messages)
            if predicted is None:
                return None
            try:
                text = self.tokenizer.apply_chat_template(predicted, add_generation_prompt=False, tools=req.tools)
            except Exception:  # the template takes the request's messages, so this is not expected: skip
                log.exception("idle re-prefill: the predicted history does not render")
                return None
            nxt = self.tokenizer.encode(text)
            same = next((i for i, (a, b) in enumerate(zip(nxt, ids)) if a != b), min(len(nxt), len(ids)))
            if len(nxt) - same < MIN_IDLE_TOKENS or len(nxt) >= self.context:
                return None
            conv.predicted_ids = nxt
            self.idle_counters["predicted_tokens"] += len(nxt)
            return nxt

    async def count(self, req: ChatRequest) -> int:
        return len(await asyncio.to_thread(self.render, req))

    async def generate(self, req: ChatRequest) -> Generation:
        """Render and check the request (off the event loop), queue it -> its Generation.
        Refusals: ServeError 4xx for the request's fault, 429 / 529 when the queue is full,
        503 while the engine is shutting down or degraded."""
        ids, forced, banned, max_tokens, next_prompt = await asyncio.to_thread(self.prepare, req)
        gen = Generation(self, ids, req, forced, banned, asyncio.get_running_loop(), max_tokens, next_prompt)
        try:
            self.scheduler.submit(gen.job)
        except QueueFull as e:
            raise ServeError(f"overloaded: {e}; retry after {RETRY_AFTER_S} s", status=429, kind="overloaded_error",
                             retry_after=RETRY_AFTER_S) from None
        except NotAccepting as e:
            raise ServeError(f"unavailable: {e}", status=503, kind="overloaded_error",
                             retry_after=RETRY_AFTER_S) from None
        return gen

    def stats(self) -> dict:
        """Telemetry, read between engine steps (the engine thread owns the counters)."""
        m = self.model
        with self.scheduler.lock:
            model_stats = m.stats()
            cache = self.state_cache.stats() if self.state_cache is not None else {"mode": "off"}
            split = m.memory.split() if m.memory is not None else None
        bw = m.bandwidth
        idle = None
        if self.rewrites is not None:
            with self._rewrites_lock:
                idle = {**self.rewrites.counters, **self.idle_counters}
        return {"model": self.model_id, "uptime_s": round(time.time() - self.started_at, 1), "idle_reprefill": idle,
                "experts": {**model_stats, "B_P_gbps": bw[0] if bw else None, "B_H_gbps": bw[1] if bw else None},
                "sessions": self.scheduler.stats(), "state_cache": cache, "memory_split": split,
                "memory": memory_stats()}


def memory_stats() -> dict:
    """Resident and peak memory of this process (Linux /proc), and the device's if it says."""
    out = {}
    try:
        for line in open("/proc/self/status"):
            if line.startswith(("VmRSS:", "VmHWM:")):
                key = "rss_bytes" if line.startswith("VmRSS") else "peak_rss_bytes"
                out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    import jax

    dev = jax.devices()[0].memory_stats() or {}
    out["device_bytes_in_use"] = dev.get("bytes_in_use")
    return out
