"""Hostile and malformed request bodies against the real server (`ftjax serve` in a
subprocess, the embedded model): Hypothesis edits a good OpenAI or Anthropic request —
any field set to any JSON value (wrong types, huge or negative numbers, NaN, lone
surrogates, nesting), fields removed, unknown fields, messages and content blocks of
any shape — and every request must end, within the client's timeout, in a 200 or a 4xx
whose error names the problem in the API's own shape: never a 500, never silence. The
server then still answers a good request and reports no failed step."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import serving

MODEL = "ftjax-default"
ROUTES = {"/v1/chat/completions": "openai", "/v1/completions": "openai", "/v1/messages": "anthropic",
          "/v1/messages/count_tokens": "anthropic"}
GOOD = {"/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        "/v1/messages": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}}
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "stop", "stop_sequences", "seed", "logit_bias", "tools", "tool_choice", "stream", "n", "system",
          "response_format", "stream_options", "metadata", "thinking", "user", "presence_penalty",
          "frequency_penalty", "logprobs", "parallel_tool_calls", "chat_template_kwargs", "unknown_field"]
MESSAGE_FIELDS = ["role", "content", "name", "tool_calls", "tool_call_id", "type", "text", "input", "id",
                  "tool_use_id", "reasoning_content"]

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, 3, -1, 2**31, 2**53 + 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["user", "assistant", "system", "tool", "developer", "function", "text", "tool_use",
                     "tool_result", "image", "auto", "none", "required", "\ud800", "<tool_call>", "</think>",
                     "<|im_end|>", MODEL]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(MESSAGE_FIELDS + FIELDS), inner, max_size=3)),
    max_leaves=8)
message = st.dictionaries(st.sampled_from(MESSAGE_FIELDS), json_values, max_size=4)
edit = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(FIELDS), json_values),
    st.tuples(st.just("drop"), st.sampled_from(FIELDS), st.none()),
    st.tuples(st.just("message"), st.integers(0, 2), message),
    st.tuples(st.just("content"), st.integers(0, 2), st.lists(st.dictionaries(
        st.sampled_from(MESSAGE_FIELDS), json_values, max_size=4), max_size=3)))


def _apply(body: dict, edits) -> dict:
    body = json.loads(json.dumps(body))
    for kind, where, value in edits:
        if kind == "set":
            body[where] = value
        elif kind == "drop":
            body.pop(where, None)
        elif isinstance(body.get("messages"), list):
            messages = body["messages"]
            while len(messages) <= where:
                messages.append({"role": "user", "content": "Go on."})
            if kind == "message":
                messages[where] = value
            elif isinstance(messages[where], dict):
                messages[where]["content"] = value
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # keep each case short: the size limits have their own tests
    return body


@pytest.fixture(scope="module")
def server():
    with serving.server("--max-batch", "4", "--state-cache", "prefix") as port:
        yield port


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(sorted(ROUTES)), edits=st.lists(edit, min_size=1, max_size=3))
def test_any_request_ends_in_a_result_or_a_named_error(server, path, edits):
    body = _apply(GOOD[path], edits)
    status, out = serving.request(server, "POST", path, body)
    assert status != 500 and (status == 200 or 400 <= status < 500), (status, body, out)
    if status == 200:
        if body.get("stream") is True:
            assert isinstance(out, str) and ("data:" in out or "event:" in out), out
        return
    assert isinstance(out, dict), (status, body, out)
    if ROUTES[path] == "anthropic":
        assert out.get("type") == "error" and out["error"]["message"], out
    else:
        assert out["error"]["type"] == "invalid_request_error" and out["error"]["message"], out


def test_the_server_still_serves_after_the_fuzz(server):
    status, out = serving.request(server, "POST", "/v1/chat/completions", GOOD["/v1/chat/completions"])
    assert status == 200 and out["choices"][0]["message"]["content"] is not None
    stats = serving.get_json(server, "/v1/stats")
    scheduler = stats.get("scheduler", stats)
    assert scheduler.get("errors", 0) == 0 and not scheduler.get("degraded"), stats
