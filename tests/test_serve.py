"""`ftjax serve`: the real server in a subprocess, driven by the official openai and
anthropic SDKs (and raw HTTP for malformed requests), checked against `Model.generate`.

One server for the module (embedded model, max batch 4, a 64 KiB body limit, 0.5 s
keepalives); one in-process model as the reference.
"""

import http.client
import json
import threading
import time

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

import ftjax  # noqa: E402
import serving  # noqa: E402

MODEL = "ftjax-default"
BODY_LIMIT = 1 << 16
TOOLS = [{"type": "function", "function": {
    "name": "search_corpus", "description": "Search the corpus",
    "parameters": {"type": "object", "properties": {"book": {"type": "string"}, "query": {"type": "string"}},
                   "required": ["book", "query"]}}}]
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]
ASK_TOOL = 'Find the passage of Emma that begins "Emma Woodhouse, handsome, clever".'
ASK_STYLE = "Write a passage in the style of Pride and Prejudice."
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server():
    """The API surface against a cold reference: no state cache (test_state_cache.py
    covers the cache and the cached-token counts it reports)."""
    with serving.server("--max-batch", "4", "--max-body-bytes", str(BODY_LIMIT), "--keepalive-s", "0.5",
                        "--state-cache", "off") as port:
        yield port


@pytest.fixture(scope="module")
def model():
    return ftjax.load()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ant(server):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server}", api_key="unused", max_retries=0)


_raw = serving.request


def _reference(model, messages, n, tools=None):
    """(prompt ids, new ids) of a greedy Model.generate on the rendered chat."""
    ids = model.tokenizer.encode_chat(messages, tools=tools)
    return ids, model.generate(ids, n)


def _user(text):
    return [{"role": "user", "content": text}]


# ---- output -------------------------------------------------------------------------------

def test_models_health(server):
    assert _raw(server, "GET", "/health") == (200, {"status": "ok", "model": MODEL})
    status, body = _raw(server, "GET", "/v1/models")
    assert status == 200 and body["data"][0]["id"] == MODEL and body["data"][0]["context_length"] == 2048


def test_greedy_chat_equals_generate(oai, ant, model):
    messages = _user("Who was Mr. Darcy?")
    ids, new = _reference(model, messages, 24)
    want = model.tokenizer.decode(new).strip()
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, **GREEDY)
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 24, len(ids) + 24)
    m = ant.messages.create(model=MODEL, messages=messages, max_tokens=24, extra_body=GREEDY)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want
    assert (m.usage.input_tokens, m.usage.output_tokens, m.stop_reason) == (len(ids), 24, "max_tokens")
    c = oai.completions.create(model=MODEL, prompt="It is a truth universally acknowledged", max_tokens=12, **GREEDY)
    prompt = model.tokenizer.encode("It is a truth universally acknowledged")
    assert c.choices[0].text == model.tokenizer.decode(model.generate(prompt, 12))
    assert c.usage.prompt_tokens == len(prompt)


def test_streaming_reasoning_split_and_usage(oai, model):
    messages = _user(ASK_STYLE)
    ids, new = _reference(model, messages, 40)
    raw = model.tokenizer.decode(new, skip_special_tokens=False)
    assert raw.startswith("<think>") and "</think>" in raw  # the model's own reasoning
    think, text = raw.removeprefix("<think>").split("</think>")
    full = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, **GREEDY).choices[0].message
    assert full.reasoning_content == think.strip() and full.content == text.strip()
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == full.reasoning_content
    assert "".join(d.content or "" for d in deltas) == full.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_stop_strings(oai, model):
    messages = _user("Who was Mr. Darcy?")
    text = model.tokenizer.decode(_reference(model, messages, 24)[1]).strip()
    stop = text.split()[3]
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, stop=[stop], **GREEDY)
    assert r.choices[0].message.content == text[:text.index(stop)].rstrip()
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 24


def test_openai_tool_call_round_trip(oai, model):
    messages = _user(ASK_TOOL)
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=60, **GREEDY)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "search_corpus"
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict) and "book" in args
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
                 {"role": "tool", "tool_call_id": call.id, "content": "Emma Woodhouse, handsome, clever, and rich"}]
    r2 = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=16, **GREEDY)
    rendered = [*messages[:1], {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": call.function.name, "arguments": call.function.arguments}}]}, messages[2]]
    ids, new = _reference(model, rendered, 16, tools=TOOLS)
    assert r2.usage.prompt_tokens == len(ids)
    assert r2.choices[0].message.content == model.tokenizer.decode(new).strip() != ""


def test_anthropic_tool_use_round_trip_streaming(ant):
    messages = _user(ASK_TOOL)
    with ant.messages.stream(model=MODEL, messages=messages, tools=A_TOOLS, max_tokens=60, extra_body=GREEDY) as s:
        kinds = [e.type for e in s]
        m = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert {"content_block_start", "content_block_stop"} <= set(kinds)
    use = next(b for b in m.content if b.type == "tool_use")
    assert m.stop_reason == "tool_use" and use.name == "search_corpus" and "book" in use.input
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "Emma Woodhouse, handsome, clever, and rich"}]}]
    m2 = ant.messages.create(model=MODEL, messages=messages, tools=A_TOOLS, max_tokens=16, extra_body=GREEDY)
    assert m2.content[0].type == "text" and m2.content[0].text and m2.usage.input_tokens > m.usage.input_tokens


def test_tool_choice_is_enforced(oai, ant):
    ask = _user("Who was Mr. Darcy?")  # no tool call on its own
    free = oai.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, max_tokens=40, **GREEDY)
    assert not free.choices[0].message.tool_calls
    forced = oai.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, max_tokens=60, **GREEDY,
                                         tool_choice={"type": "function", "function": {"name": "search_corpus"}})
    call = forced.choices[0].message.tool_calls[0]
    assert call.function.name == "search_corpus" and isinstance(json.loads(call.function.arguments), dict)
    m = ant.messages.create(model=MODEL, messages=ask, tools=A_TOOLS, max_tokens=60, extra_body=GREEDY,
                            tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use" and m.content[-1].name == "search_corpus"
    none = oai.chat.completions.create(model=MODEL, messages=_user(ASK_TOOL), tools=TOOLS, tool_choice="none",
                                       max_tokens=30, **GREEDY)
    assert not none.choices[0].message.tool_calls and "<tool_call>" not in none.choices[0].message.content


def test_anthropic_thinking_and_count_tokens(ant, model):
    ask = _user("Who was Mr. Darcy?")  # no reasoning on its own: forced on, held to 6 tokens
    m = ant.messages.create(model=MODEL, messages=ask, max_tokens=30, extra_body=GREEDY,
                            thinking={"type": "enabled", "budget_tokens": 6})
    think = model.tokenizer.added_token_ids["<think>"]
    reasoning = model.generate(model.tokenizer.encode_chat(ask) + [think], 6)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[1].text
    assert m.content[0].thinking == model.tokenizer.decode(reasoning).strip()
    n = ant.messages.count_tokens(model=MODEL, system="Be brief.", messages=_user(ASK_TOOL), tools=A_TOOLS)
    want = model.tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, *_user(ASK_TOOL)], tools=TOOLS)
    assert n.input_tokens == len(want)


# ---- concurrency and cancellation ------------------------------------------------------------

def test_concurrent_requests_decode_together(oai, model, server):
    asks = ["Who was Mr. Darcy?", "Go on.", "Tell me about Emma.", "To be, or not to be", "Hello", "Who is Hamlet?"]
    want = [model.tokenizer.decode(_reference(model, _user(a), 20)[1]).strip() for a in asks]
    got = [None] * len(asks)

    def ask(i):
        r = oai.chat.completions.create(model=MODEL, messages=_user(asks[i]), max_tokens=20, **GREEDY)
        got[i] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    stats = _raw(server, "GET", "/v1/stats")[1]
    assert 2 <= stats["sessions"]["peak_active"] <= 4  # batched, never above --max-batch
    assert stats["experts"]["selections"] > 0 and stats["memory"]["rss_bytes"] > 0


def _sessions(port):
    return _raw(port, "GET", "/v1/stats")[1]["sessions"]


def test_disconnect_cancels_and_frees(server):
    before = _sessions(server)["cancelled"]
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=30)
    body = {"model": MODEL, "messages": _user("Go on."), "max_tokens": 1500, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    for _ in range(5):
        r.fp.readline()
    assert _sessions(server)["active"] == 1
    r.close()
    conn.sock.close()
    deadline = time.time() + 5
    while time.time() < deadline and (_sessions(server)["active"] or _sessions(server)["cancelled"] == before):
        time.sleep(0.05)
    s = _sessions(server)
    assert s["active"] == 0 and s["prefilling"] == 0 and s["queued"] == 0 and s["cancelled"] == before + 1


# ---- bad requests ------------------------------------------------------------------------------

GOOD_CHAT = {"model": MODEL, "messages": _user("Hi"), "max_tokens": 2}
GOOD_MSG = {"model": MODEL, "messages": _user("Hi"), "max_tokens": 2}
LONG = "the " * 2100
BAD = [
    ("/v1/chat/completions", b'{"model": "ftjax-default", "messages": [', 400, "malformed JSON"),
    ("/v1/chat/completions", b'[1, 2]', 400, "JSON object"),
    ("/v1/chat/completions", {**GOOD_CHAT, "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/chat/completions", {**GOOD_CHAT, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {**GOOD_CHAT, "model": "gpt-4o"}, 404, "gpt-4o"),
    ("/v1/chat/completions", {**GOOD_CHAT, "messages": _user(LONG)}, 400, "does not fit the context"),
    ("/v1/chat/completions", {**GOOD_CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {**GOOD_CHAT, "max_tokens": 5000}, 400, "above the context"),
    ("/v1/chat/completions", {**GOOD_CHAT, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {**GOOD_CHAT, "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {**GOOD_CHAT, "tools": [{"type": "function", "function": {
        "name": "bad name!", "parameters": {"type": "object"}}}]}, 400, "invalid tool name"),
    ("/v1/chat/completions", {**GOOD_CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]}, 400, "parameters schema"),
    ("/v1/chat/completions", {**GOOD_CHAT, "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "nope"),
    ("/v1/chat/completions", {**GOOD_CHAT, "n": 2}, 400, "n=2"),
    ("/v1/chat/completions", {**GOOD_CHAT, "frobnicate": True}, 400, "frobnicate"),
    ("/v1/chat/completions", {**GOOD_CHAT, "messages": _user("x" * BODY_LIMIT)}, 413, "limit"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/messages", b"{not json", 400, "malformed JSON"),
    ("/v1/messages", {"model": MODEL, "messages": _user("Hi")}, 400, "max_tokens"),
    ("/v1/messages", {**GOOD_MSG, "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/messages", {**GOOD_MSG, "model": "claude-x"}, 404, "claude-x"),
    ("/v1/messages", {**GOOD_MSG, "temperature": 1.5}, 400, "temperature"),
    ("/v1/messages", {**GOOD_MSG, "tools": [{"name": "f"}]}, 400, "input_schema"),
    ("/v1/messages", {**GOOD_MSG, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400, "image"),
    ("/v1/messages", {**GOOD_MSG, "output_config": {"format": {"type": "json_schema"}}}, 400, "output_config"),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": []}, 400, "messages"),
    # values that would fail later, inside a step, are refused at the door by name
    ("/v1/chat/completions", {**GOOD_CHAT, "seed": 2**64}, 400, "seed"),
    ("/v1/chat/completions", b'{"model": "ftjax-default", "messages": [{"role": "user", "content": "Hi"}], '
                             b'"temperature": NaN}', 400, "temperature"),
    ("/v1/chat/completions", {**GOOD_CHAT, "stop": ["a"] * 17}, 400, "at most 16"),
    ("/v1/chat/completions", {**GOOD_CHAT, "stop": "x" * 300}, 400, "at most 256"),
    ("/v1/chat/completions", {**GOOD_CHAT, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {**GOOD_CHAT, "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("/v1/chat/completions", {**GOOD_CHAT, "logit_bias": {"99999": 1}}, 400, "vocabulary"),
    ("/v1/messages", {**GOOD_MSG, "top_k": 2**40}, 400, "top_k"),
    ("/v1/messages", {**GOOD_MSG, "top_p": 0}, 400, "top_p"),
    ("/v1/messages", {**GOOD_MSG, "stop_sequences": [""]}, 400, "stop_sequences"),
]


@pytest.mark.parametrize("path,body,status,needle", BAD, ids=[f"{p}-{n}" for p, _, _, n in BAD])
def test_bad_request_named_and_server_keeps_serving(server, path, body, status, needle):
    code, err = _raw(server, "POST", path, body)
    assert code == status
    if path.startswith("/v1/messages"):
        assert err["type"] == "error" and needle in err["error"]["message"]
    else:
        assert needle in err["error"]["message"] and err["error"]["type"] == "invalid_request_error"
    good = GOOD_MSG if path.startswith("/v1/messages") else GOOD_CHAT
    assert _raw(server, "POST", "/v1/messages" if path.startswith("/v1/messages") else "/v1/chat/completions",
                good)[0] == 200


def test_logit_bias_bans_and_forces_inside_the_sampler(oai, model):
    """-100 bans a token (greedy takes the next best, and the rest follows from it), +100
    forces one at every step; sampled rows never draw a banned token."""
    ids, want = _reference(model, _user(ASK_STYLE), 4)
    first = want[0]
    ask = {"model": MODEL, "messages": _user(ASK_STYLE), "max_tokens": 4}
    logits = model.logits(ids)[-1].copy()
    logits[first] = -float("inf")
    alt = int(logits.argmax())
    expected = model.tokenizer.decode([alt] + model.generate(ids + [alt], 3)).strip()
    banned = oai.chat.completions.create(**ask, **GREEDY, logit_bias={str(first): -100})
    assert banned.choices[0].message.content == expected
    forced = model.tokenizer.encode(" Darcy")[0]
    r = oai.chat.completions.create(**ask, **GREEDY, logit_bias={str(forced): 100})
    assert r.choices[0].message.content.replace(" ", "") == model.tokenizer.decode([forced]).strip() * 4
    for seed in range(3):  # sampled: the banned token is never drawn
        r = oai.chat.completions.create(**ask, temperature=1.0, seed=seed, logit_bias={str(first): -100})
        assert not r.choices[0].message.content.startswith(model.tokenizer.decode([first]).strip())


def test_request_timeout_header(server):
    code, err = _raw(server, "POST", "/v1/chat/completions", GOOD_CHAT, {"X-Request-Timeout": "soon"})
    assert code == 400 and "X-Request-Timeout" in err["error"]["message"]
    code, err = _raw(server, "POST", "/v1/chat/completions", {**GOOD_CHAT, "max_tokens": 1500},
                     {"X-Request-Timeout": "0.3"})
    assert code == 504 and "deadline" in err["error"]["message"] and err["error"]["type"] == "timeout_error"
    code, err = _raw(server, "POST", "/v1/messages", {**GOOD_MSG, "max_tokens": 1500}, {"X-Request-Timeout": "0.3"})
    assert code == 504 and err["error"]["type"] == "timeout_error"
    assert _raw(server, "POST", "/v1/chat/completions", GOOD_CHAT)[0] == 200


def test_serve_options_are_checked_before_loading(capsys):
    from ftjax import cli

    assert cli.main(["serve", "--max-batch", "0"]) == 2
    assert "--max-batch must be positive" in capsys.readouterr().err
    assert cli.main(["serve", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
