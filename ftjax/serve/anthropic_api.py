"""Anthropic adapter: /v1/messages and /v1/messages/count_tokens.

Translates Messages API requests (system, content blocks: text / thinking / tool_use /
tool_result) to `core.ChatRequest`, and core events to content blocks: reasoning as
`thinking`, text as `text`, tool calls as `tool_use` with a parsed `input`. Streaming
sends the full event sequence: message_start, content_block_start / _delta / _stop per
block, message_delta (stop_reason, usage), message_stop, and `ping` while nothing is
produced (queue, long prefill). Errors: `{"type": "error", "error": {"type", "message"}}`.

`thinking: {"type": "enabled", "budget_tokens": N}` forces the `<think>` token first,
so the reply opens with reasoning, and forces `</think>` after N reasoning tokens.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from pydantic import Field

from ftjax.serve.core import (ChatRequest, Delta, Done, Engine, Generation, ServeError, ToolCall, check_tools, collect,
                              done_error)
from ftjax.serve.schemas import Open, parse, refuse_unknown, sampling, stops

IGNORED = {"metadata", "service_tier", "cache_control", "container", "context_management", "diagnostics",
           "inference_geo", "speed", "user_profile_id", "workspace_id", "output_config"}
STOP_REASON = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens", "context": "max_tokens",
               "cancelled": "end_turn"}


class TextBlock(Open):
    type: Literal["text"]
    text: str


class ThinkingBlock(Open):
    type: Literal["thinking"]
    thinking: str


class RedactedThinkingBlock(Open):
    type: Literal["redacted_thinking"]


class ToolUseBlock(Open):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(Open):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


Block = Annotated[Union[TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock, ToolResultBlock],
                  Field(discriminator="type")]


class MessageIn(Open):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolIn(Open):
    name: str
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None


class ToolChoice(Open):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Open):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountTokensRequest(Open):
    model: str
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content or [])


def _turn(m: MessageIn) -> list[dict]:
    """One Anthropic message -> template messages (tool results become `tool` messages)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out, text, reasoning, calls = [], [], None, []
    for i, b in enumerate(m.content):
        if isinstance(b, (ToolUseBlock, ThinkingBlock) if m.role == "user" else ToolResultBlock):
            raise ServeError(f"a {m.role} message cannot hold a {b.type} block (content[{i}])", param="messages")
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ThinkingBlock):
            reasoning = b.thinking
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
        elif isinstance(b, ToolResultBlock):
            out.append({"role": "tool", "content": _text(b.content), "tool_call_id": b.tool_use_id})
    if text or not out or calls:
        msg = {"role": m.role, "content": "".join(text)}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _request(r: CountTokensRequest, engine: Engine, max_tokens: int) -> ChatRequest:
    refuse_unknown(r, IGNORED | ({"max_tokens", "stream", "temperature", "top_p", "top_k", "stop_sequences"}
                                 if not isinstance(r, MessagesRequest) else set()))
    engine.check_model(r.model)
    output = (r.model_extra or {}).get("output_config")
    if isinstance(output, dict) and output.get("format"):
        raise ServeError("unsupported option: output_config.format (structured output)", param="output_config")
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in r.tools or []] or None
    tc = r.tool_choice
    choice = {None: "auto", "auto": "auto", "any": "required", "none": "none", "tool": "tool"}[tc and tc.type]
    if choice == "tool":
        if not tc.name:
            raise ServeError("tool_choice of type \"tool\" needs a \"name\"", param="tool_choice")
        choice = {"name": tc.name}
    check_tools(tools, choice)
    messages = [{"role": "system", "content": _text(r.system)}] if r.system else []
    for m in r.messages:
        messages += _turn(m)
    think = r.thinking is not None and r.thinking.type == "enabled"
    if think:
        if r.thinking.budget_tokens is None or not 1 <= r.thinking.budget_tokens < max_tokens:
            raise ServeError(f"thinking.budget_tokens must be at least 1 and less than max_tokens ({max_tokens}), "
                             f"got {r.thinking.budget_tokens}", param="thinking.budget_tokens")
        if tools and choice not in ("auto", "none"):
            raise ServeError("thinking may not be enabled when tool_choice forces tool use", param="thinking")
    s = r if isinstance(r, MessagesRequest) else None
    return ChatRequest(messages=messages, max_tokens=max_tokens, tools=tools, tool_choice=choice, think=think,
                       think_budget=r.thinking.budget_tokens if think else None,
                       sampling=sampling(s and s.temperature, s and s.top_p, s and s.top_k, None, 1.0),
                       stop=stops(s and s.stop_sequences, "stop_sequences"))


def messages_request(body, engine: Engine) -> tuple[MessagesRequest, ChatRequest]:
    r = parse(MessagesRequest, body)
    return r, _request(r, engine, r.max_tokens)


async def count_tokens(body, engine: Engine) -> dict:
    r = parse(CountTokensRequest, body)
    return {"input_tokens": await engine.count(_request(r, engine, engine.context))}


def error_json(e: ServeError) -> dict:
    """Anthropic's error object: {"type": "error", "error": {type, message}}."""
    return {"type": "error", "error": {"type": e.kind, "message": e.message}}


# ---- responses -------------------------------------------------------------------------------

def _stop(done: Done, tool_use: bool) -> tuple[str, str | None]:
    if tool_use:
        return "tool_use", None
    return STOP_REASON.get(done.reason, "end_turn"), done.stop_sequence if done.reason == "stop" else None


def _tool_use(c: ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + c.id, "name": c.name, "input": json.loads(c.arguments)}


def _message(engine: Engine, mid: str, content: list, done: Done | None, prompt_tokens: int) -> dict:
    reason, seq = _stop(done, any(b["type"] == "tool_use" for b in content)) if done else (None, None)
    return {"id": mid, "type": "message", "role": "assistant", "model": engine.model_id, "content": content,
            "stop_reason": reason, "stop_sequence": seq,
            "usage": _usage(done, prompt_tokens)}


def _usage(done: Done | None, prompt_tokens: int) -> dict:
    """Anthropic's split: input_tokens are the prompt tokens prefilled, cache_read_input_tokens
    those restored from the state cache (known once the request is admitted: a stream's
    message_start says 0 read, its message_delta the real split)."""
    cached = done.cached_tokens if done else 0
    return {"input_tokens": prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": done.completion_tokens if done else 0}


async def response(engine: Engine, gen: Generation, disconnected) -> dict:
    out = await collect(gen, disconnected)
    content = [{"type": "thinking", "thinking": out.reasoning, "signature": ""}] if out.reasoning else []
    if out.text or not (content or out.tool_calls):
        content.append({"type": "text", "text": out.text})
    content += [_tool_use(c) for c in out.tool_calls]
    return _message(engine, "msg_" + gen.id, content, out.done, gen.prompt_tokens)


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The open content block of a stream: a new kind closes it and opens the next."""

    START = {"reasoning": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""}}
    DELTA = {"reasoning": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}

    def __init__(self):
        self.index, self.kind, self.tool_use = -1, None, False

    def close(self) -> list[str]:
        out = [_event("content_block_stop", {"index": self.index})] if self.kind else []
        self.kind = None
        return out

    def open(self, kind: str, block: dict) -> list[str]:
        out = self.close()
        self.index, self.kind = self.index + 1, kind
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def delta(self, e: Delta) -> list[str]:
        out = self.open(e.kind, self.START[e.kind]) if self.kind != e.kind else []
        kind, field = self.DELTA[e.kind]
        return out + [_event("content_block_delta", {"index": self.index, "delta": {"type": kind, field: e.text}})]

    def tool(self, c: ToolCall) -> list[str]:
        self.tool_use = True
        block = {**_tool_use(c), "input": {}}
        return self.open("tool_use", block) + [_event("content_block_delta", {
            "index": self.index, "delta": {"type": "input_json_delta", "partial_json": c.arguments}})] + self.close()


async def stream(engine: Engine, gen: Generation, keepalive_s: float):
    mid, blocks = "msg_" + gen.id, _Blocks()
    try:
        yield _event("message_start", {"message": _message(engine, mid, [], None, gen.prompt_tokens)})
        async for e in gen.events(keepalive_s):
            if e is None:
                yield _event("ping", {})
            elif isinstance(e, Delta):
                for s in blocks.delta(e):
                    yield s
            elif isinstance(e, ToolCall):
                for s in blocks.tool(e):
                    yield s
            elif done_error(e) is not None:
                yield _event("error", error_json(done_error(e)))
            else:
                for s in blocks.close():
                    yield s
                reason, seq = _stop(e, blocks.tool_use)
                yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                               "usage": _usage(e, gen.prompt_tokens)})
                yield _event("message_stop", {})
    finally:
        gen.cancel()
