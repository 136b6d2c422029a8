"""OpenAI adapter: /v1/chat/completions, /v1/completions, /v1/models.

Translates OpenAI requests to `core.ChatRequest` and core events to OpenAI JSON:
reasoning as `reasoning_content`, tool calls as `tool_calls` with JSON `arguments`,
SSE chunks ending in `data: [DONE]` (keepalive comments while nothing is produced),
`usage` on every response (and as a last chunk with `stream_options.include_usage`).
Errors: `{"error": {"message", "type", "param", "code"}}` (app.py).
"""

from __future__ import annotations

import json
import time
from typing import Literal

from pydantic import Field

from ftjax.serve.core import (ChatRequest, Delta, Done, Engine, Generation, ServeError, ToolCall, check_tools, collect,
                              done_error)
from ftjax.serve.schemas import Open, Strict, logit_bias, parse, refuse_unknown, refuse_values, sampling, stops

IGNORED = {"user", "metadata", "store", "parallel_tool_calls", "service_tier", "prompt_cache_key",
           "safety_identifier", "top_logprobs", "reasoning_effort", "modalities", "verbosity"}
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCallIn(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    name: str | None = None


class Function(Open):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: Function


class NamedFunction(Strict):
    name: str


class NamedChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Open):
    include_usage: bool = False


class Common(Open):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None


class ChatCompletionRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedChoice | None = None
    logprobs: bool | None = None
    response_format: dict | None = None


class CompletionRequest(Common):
    prompt: str | list[str]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


def _check_common(r: Common) -> None:
    refuse_unknown(r, IGNORED)
    refuse_values(n=(r.n, 1), presence_penalty=(r.presence_penalty, 0), frequency_penalty=(r.frequency_penalty, 0))


def error_json(e: ServeError) -> dict:
    """OpenAI's error object: {"error": {message, type, param, code}}."""
    kind = {"overloaded_error": "rate_limit_error" if e.status == 429 else "server_error",
            "not_found_error": "invalid_request_error", "request_too_large": "invalid_request_error"}.get(e.kind, e.kind)
    code = {"not_found_error": "model_not_found", "request_too_large": "request_too_large",
            "overloaded_error": "rate_limit_exceeded" if e.status == 429 else "unavailable",
            "timeout_error": "timeout"}.get(e.kind)
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": code}}


def _content(m: Message) -> str:
    return m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])


def _message(m: Message) -> dict:
    out = {"role": "system" if m.role == "developer" else m.role, "content": _content(m)}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in m.tool_calls]
    if m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    return out


def chat_request(body, engine: Engine) -> tuple[ChatCompletionRequest, ChatRequest]:
    r = parse(ChatCompletionRequest, body)
    _check_common(r)
    engine.check_model(r.model)
    refuse_values(logprobs=(r.logprobs or None, None),
                  response_format=((r.response_format or {}).get("type", "text"), "text"))
    tools = [t.model_dump(exclude_none=True) for t in r.tools] if r.tools else None
    choice = r.tool_choice or "auto"
    if isinstance(choice, NamedChoice):
        choice = {"name": choice.function.name}
    check_tools(tools, choice)
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    req = ChatRequest(messages=[_message(m) for m in r.messages], max_tokens=max_tokens,
                      sampling=sampling(r.temperature, r.top_p, None, r.seed, 2.0), stop=stops(r.stop, "stop"),
                      tools=tools, tool_choice=choice, logit_bias=logit_bias(r.logit_bias))
    return r, req


def completion_request(body, engine: Engine) -> tuple[CompletionRequest, ChatRequest]:
    r = parse(CompletionRequest, body)
    _check_common(r)
    engine.check_model(r.model)
    refuse_values(logprobs=(r.logprobs, None), echo=(r.echo or None, None), suffix=(r.suffix, None),
                  best_of=(r.best_of, 1))
    prompts = [r.prompt] if isinstance(r.prompt, str) else r.prompt
    if len(prompts) != 1:
        raise ServeError(f"unsupported option: prompt as a list of {len(prompts)} prompts (send one per request)",
                         param="prompt")
    req = ChatRequest(messages=None, prompt=prompts[0], max_tokens=16 if r.max_tokens is None else r.max_tokens,
                      sampling=sampling(r.temperature, r.top_p, None, r.seed, 2.0), stop=stops(r.stop, "stop"),
                      logit_bias=logit_bias(r.logit_bias))
    return r, req


# ---- responses -------------------------------------------------------------------------------

def usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


def _finish(done: Done, tool_calls: bool) -> str:
    return "tool_calls" if tool_calls else FINISH.get(done.reason, "stop")


def _tool_call(c: ToolCall, index: int | None = None) -> dict:
    out = {"id": "call_" + c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
    return out if index is None else {"index": index, **out}


def _head(kind: str, rid: str, model: str) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


async def chat_response(engine: Engine, gen: Generation, disconnected) -> dict:
    out = await collect(gen, disconnected)
    message = {"role": "assistant", "content": out.text or (None if out.tool_calls else "")}
    if out.reasoning:
        message["reasoning_content"] = out.reasoning
    if out.tool_calls:
        message["tool_calls"] = [_tool_call(c) for c in out.tool_calls]
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": _finish(out.done, bool(out.tool_calls))}
    return {**_head("chat.completion", "chatcmpl-" + gen.id, engine.model_id), "choices": [choice],
            "usage": usage(out.done)}


async def completion_response(engine: Engine, gen: Generation, disconnected) -> dict:
    out = await collect(gen, disconnected)
    choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": _finish(out.done, False)}
    return {**_head("text_completion", "cmpl-" + gen.id, engine.model_id), "choices": [choice],
            "usage": usage(out.done)}


def _data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def stream(engine: Engine, gen: Generation, include_usage: bool, keepalive_s: float, chat: bool):
    """SSE chunks of a chat completion (chat=True) or a text completion."""
    head = _head("chat.completion.chunk" if chat else "text_completion", ("chatcmpl-" if chat else "cmpl-") + gen.id,
                 engine.model_id)

    def chunk(delta: dict | None = None, finish: str | None = None, text: str | None = None) -> str:
        c = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish} if chat else \
            {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return _data({**head, "choices": [c]})

    calls = 0
    try:
        if chat:
            yield chunk({"role": "assistant", "content": ""})
        async for e in gen.events(keepalive_s):
            if e is None:
                yield ": keepalive\n\n"
            elif isinstance(e, Delta):
                key = "reasoning_content" if e.kind == "reasoning" else "content"
                yield chunk({key: e.text}, text=e.text)
            elif isinstance(e, ToolCall):
                yield chunk({"tool_calls": [_tool_call(e, calls)]})
                calls += 1
            elif done_error(e) is not None:
                yield _data(error_json(done_error(e)))
            else:
                yield chunk(finish=_finish(e, calls > 0))
                if include_usage:
                    yield _data({**head, "choices": [], "usage": usage(e)})
        yield "data: [DONE]\n\n"
    finally:
        gen.cancel()  # no-op when finished; frees the row when the client went away


def models(engine: Engine) -> dict:
    return {"object": "list", "data": [{"id": engine.model_id, "object": "model", "created": int(engine.started_at),
                                        "owned_by": "ftjax", "context_length": engine.context,
                                        "max_model_len": engine.context}]}
