"""ftjax.tokenizer agrees with transformers on the default model and on other chat templates."""

import json
import shutil
from pathlib import Path

import jinja2
import pytest

from ftjax.data import corpus
from ftjax.tokenizer import StreamDecoder, Tokenizer

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "ftjax" / "default_model"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONTROL = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_output>", "</tool_output>"]
UNICODE = [
    "naïve café, Œuvre — “quotes” …",
    "日本語のテキストと中文混合",
    "emoji 😀👍🏽 and flags 🇫🇷, zwj 👩‍👩‍👧",
    "math ∑ᵢ xᵢ² ≤ ∞; arrows ⟶ ⇒",
    "tabs\tand\r\nwindows newlines\n\n\n  indented   spaces  ",
    "numbers 3.14159 and 1,000,000 and 0x1F",
    "",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CHATS = {
    "user": [{"role": "user", "content": "Hello there, how are you?"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye ✌️"},
    ],
    "agent": [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I need the tool.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp_c": 21}'},
        {"role": "assistant", "content": "It is 21 °C.", "reasoning": "Report it."},
        {"role": "user", "content": "Thanks"},
    ],
}

# Close to Qwen2.5's template, plus Qwen3's enable_thinking switch.
QWEN_LIKE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.reasoning_content is defined %}{{ '<think>' + message.reasoning_content + '</think>' }}{% endif %}
        {{- message.content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

# Mistral-like: bos/eos variables, namespace, loop controls, raise_exception, generation tag.
MISTRAL_LIKE = (
    "{{ bos_token }}{% set ns = namespace(turn=0) %}{% for m in messages %}"
    "{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% if (m.role == 'user') != (ns.turn % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}"
    "{% set ns.turn = ns.turn + 1 %}"
    "{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
    "{% else %}{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}{% endif %}"
    "{% endfor %}{{ strftime_now('') }}{{ extra | default('') }}"
)


# The shape of Qwen3.5 / Qwen3.6's template (the paper's model family): tools listed as XML
# <function> blocks with their parameters, tool calls written as <function=...><parameter=...>
# inside <tool_call>, tool results folded into one user turn of <tool_response> blocks,
# reasoning kept only for turns after the last real user query, and a thinking switch.
QWEN35_LIKE = r"""{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if tools is iterable and tools | length > 0 %}
    {{- '<|im_start|>system\n' }}
    {%- if system_message is defined %}{{- system_message + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
    {%- for tool in tools %}
        {%- if tool.function is defined %}{%- set tool = tool.function %}{%- endif %}
        {{- '\n<function>\n<name>' ~ tool.name ~ '</name>' }}
        {%- if tool.description is defined %}{{- '\n<description>' ~ (tool.description | trim) ~ '</description>' }}{%- endif %}
        {{- '\n<parameters>' }}
        {%- if tool.parameters is defined and tool.parameters is mapping and tool.parameters.properties is defined %}
            {%- for param_name, param_fields in tool.parameters.properties | items %}
                {{- '\n<parameter>\n<name>' ~ param_name ~ '</name>' }}
                {%- if param_fields.type is defined %}{{- '\n<type>' ~ (param_fields.type | string) ~ '</type>' }}{%- endif %}
                {{- '\n</parameter>' }}
            {%- endfor %}
        {%- endif %}
        {%- if tool.parameters is defined and tool.parameters.required is defined %}{{- '\n<required>' ~ (tool.parameters.required | tojson) ~ '</required>' }}{%- endif %}
        {{- '\n</parameters>\n</function>' }}
    {%- endfor %}
    {{- "\n</tools>\n\nTo call a function, reply in this format:\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n" }}
{%- elif system_message is defined %}
    {{- '<|im_start|>system\n' + system_message + '<|im_end|>\n' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- set loop_index = loop.index0 + (1 if system_message is defined else 0) %}
        {%- if loop_index > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls | default([]) %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- ('\n\n' if loop.first and content | trim else ('' if loop.first else '\n')) + '<tool_call>\n<function=' + tool_call.name + '>\n' }}
            {%- if tool_call.arguments is mapping %}
                {%- for args_name, args_value in tool_call.arguments | items %}
                    {%- set args_value = args_value | tojson if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                    {{- '<parameter=' + args_name + '>\n' + args_value + '\n</parameter>\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or loop.previtem.role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != "tool" %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('unexpected role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- else %}{{- '<think>\n' }}{%- endif %}
{%- endif %}"""


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def snippets():
    out = []
    for name in corpus.names():
        valid = corpus.split(name)[1]
        out += [valid[:3000], valid[-1500:]]
    return out


def _model_dir(tmp_path, template, **config_overrides):
    """A copy of the default model's tokenizer with another chat template."""
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(DEFAULT_MODEL / "tokenizer.json", d / "tokenizer.json")
    config = json.loads((DEFAULT_MODEL / "tokenizer_config.json").read_text())
    config.update(chat_template=template, **config_overrides)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


# ---------------------------------------------------------------- vocabulary and special tokens


def test_default_model_metadata(tok):
    assert tok.vocab_size == 4096
    assert tok.bos_token_id is None
    # tokenizer_config's eos plus the model's config.json / generation_config.json eos ids
    assert tok.eos_token_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    assert tok.pad_token_id == tok.token_to_id("<|endoftext|>")
    assert tok.special_ids == {tok.token_to_id(t) for t in SPECIAL}
    assert set(tok.added_token_ids) == set(SPECIAL + CONTROL)
    config = json.loads((DEFAULT_MODEL / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (DEFAULT_MODEL / "chat_template.jinja").read_text()


@pytest.mark.parametrize("token", SPECIAL + CONTROL)
def test_each_added_token_is_one_id(tok, hf, token):
    token_id = tok.token_to_id(token)
    assert token_id is not None and token_id >= 4096 - len(SPECIAL + CONTROL)
    assert tok.encode(token) == [token_id]
    ids = tok.encode(f"before{token}after and again {token}")
    assert ids.count(token_id) == 2
    assert hf.convert_tokens_to_ids(token) == token_id


def test_skip_special_tokens_keeps_control_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\n<think>\nhm\n</think>\nok<|im_end|><|endoftext|>")
    assert tok.decode(ids) == "assistant\n<think>\nhm\n</think>\nok"
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>assistant")


# ---------------------------------------------------------------- encode / decode


def test_round_trip(tok, snippets):
    for text in snippets + UNICODE:
        assert tok.decode(tok.encode(text)) == text


def test_agrees_with_transformers_on_encode_decode(tok, hf, snippets):
    texts = snippets + UNICODE + ["<|im_start|>user\nhi<|im_end|>\n<tool_call>{}</tool_call>"]
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_compression_is_sane(tok, snippets):
    text = "".join(snippets)
    assert len(text.encode()) / len(tok.encode(text)) > 3.0


# ---------------------------------------------------------------- chat templates


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("gen", [True, False], ids=["gen", "no_gen"])
def test_chat_template_matches_transformers(tok, hf, chat, tools, gen):
    messages = CHATS[chat]
    want = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
    assert tok.apply_chat_template(messages, add_generation_prompt=gen, tools=tools) == want
    assert tok.encode_chat(messages, gen, tools) == hf.encode(want, add_special_tokens=False)


def test_default_template_layout(tok):
    got = tok.apply_chat_template(CHATS["system"])
    assert got == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye ✌️<|im_end|>\n<|im_start|>assistant\n"
    )
    agent = tok.apply_chat_template(CHATS["agent"], tools=TOOLS)
    assert '<tools>\n{"type": "function"' in agent
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<think>\nI need the tool.\n</think>\n{call}<|im_end|>" in agent
    assert '<|im_start|>tool\n<tool_output>\n{"temp_c": 21}\n</tool_output><|im_end|>' in agent


def test_default_template_is_append_only(tok):
    # Agent sessions reuse the KV cache of earlier turns: rendering must only ever append.
    chat = CHATS["agent"]
    for k in range(1, len(chat)):
        assert tok.apply_chat_template(chat, False, TOOLS).startswith(tok.apply_chat_template(chat[:k], False, TOOLS))


@pytest.mark.parametrize("template", [QWEN_LIKE, MISTRAL_LIKE, QWEN35_LIKE], ids=["qwen_like", "mistral_like", "qwen35_like"])
def test_other_templates_match_transformers(tmp_path, template):
    transformers = pytest.importorskip("transformers")
    d = _model_dir(tmp_path, template, bos_token="<|endoftext|>")
    ours = Tokenizer.from_dir(d)
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    cases = [(CHATS["user"], None, {}), (CHATS["system"], None, {"extra": "!"})]
    if template is not MISTRAL_LIKE:
        cases += [(CHATS["agent"], TOOLS, {}), (CHATS["user"], None, {"enable_thinking": False})]
    if template is QWEN35_LIKE:  # reasoning inline in content, a tool result ending the chat, parallel calls
        inline = [*CHATS["agent"][:2], {"role": "assistant", "content": "<think>\nLook it up.\n</think>\n\nOne moment.",
                  "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                                 {"function": {"name": "get_weather", "arguments": {"city": ["Lyon", "Nice"]}}}]},
                  {"role": "tool", "content": "21"}, {"role": "tool", "content": "25"}]
        cases += [(inline, TOOLS, {})]
    for messages, tools, kwargs in cases:
        for gen in (True, False):
            want = theirs.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=gen, **kwargs
            )
            assert ours.apply_chat_template(messages, gen, tools, **kwargs) == want


def test_template_raise_exception(tmp_path):
    ours = Tokenizer.from_dir(_model_dir(tmp_path, MISTRAL_LIKE))
    bad = [{"role": "assistant", "content": "first"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="roles must alternate"):
        ours.apply_chat_template(bad)


def test_chat_template_jinja_file_wins(tmp_path):
    d = _model_dir(tmp_path, "from config")
    (d / "chat_template.jinja").write_text("from file")
    assert Tokenizer.from_dir(d).apply_chat_template(CHATS["user"]) == "from file"


def test_missing_chat_template(tmp_path):
    d = _model_dir(tmp_path, None)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(d).apply_chat_template(CHATS["user"])


# ---------------------------------------------------------------- streaming


def test_stream_decoder_waits_for_complete_characters(tok):
    text = "Grüße 😀👍🏽 日本語 and “quotes” <think>é</think>"
    ids = tok.encode(text)
    # The 4096-token vocabulary splits the emoji and CJK characters over several byte tokens.
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids)))
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0  # held back while a character was partial


@pytest.mark.parametrize("skip", [True, False])
def test_stream_decoder_reproduces_decode(tok, snippets, skip):
    ids = tok.encode_chat(CHATS["agent"], tools=TOOLS) + tok.encode(snippets[0][:500] + UNICODE[2])
    streamed = "".join(tok.stream_decoder(skip_special_tokens=skip).stream(ids))
    assert streamed == tok.decode(ids, skip_special_tokens=skip)


def test_stream_decoder_flushes_incomplete_bytes(tok):
    ids = tok.encode("ok 😀")
    partial = ids[:-1]  # the emoji's last byte never arrives
    dec = StreamDecoder(tok)
    out = "".join(dec.push(i) for i in partial)
    assert "\ufffd" not in out
    assert out + dec.flush() == tok.decode(partial)


# ---------------------------------------------------------------- loading and errors


def test_eos_ids_from_generation_config_and_config(tmp_path):
    d = _model_dir(tmp_path, "x")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [4087, 4089]}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 7, "bos_token_id": 1}))
    assert Tokenizer.from_dir(d).eos_token_ids == {4087, 4089, 7}
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 4088}))
    assert Tokenizer.from_dir(d).eos_token_ids == {4088, 4089, 7}


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no tokenizer.json in model folder {tmp_path}"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("fname", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_malformed_json_names_file(tmp_path, fname):
    d = _model_dir(tmp_path, "x")
    (d / fname).write_text('{"model": ')
    with pytest.raises(ValueError, match=f"malformed JSON in {d / fname}"):
        Tokenizer.from_dir(d)


def test_invalid_tokenizer_json_schema(tmp_path):
    d = _model_dir(tmp_path, "x")
    (d / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ValueError, match="cannot load .*tokenizer.json"):
        Tokenizer.from_dir(d)


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        ["hello"],
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": 3, "content": "x"}],
        {"role": "user", "content": "a dict, not a list"},
    ],
)
def test_bad_messages(tok, messages):
    with pytest.raises(ValueError, match="message"):
        tok.apply_chat_template(messages)


def test_bad_tools(tok):
    with pytest.raises(ValueError, match="tools"):
        tok.apply_chat_template(CHATS["user"], tools=["not a schema"])


@pytest.mark.slow
def test_retraining_reproduces_default_tokenizer(tmp_path):
    import subprocess
    import sys

    script = DEFAULT_MODEL.parents[1] / "scripts" / "train_tokenizer.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], check=True, capture_output=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (DEFAULT_MODEL / name).read_bytes(), name


def test_encode_rejects_what_is_not_text(tok):
    assert tok.encode("caf\u00e9".encode("utf-8")) == tok.encode("caf\u00e9")
    with pytest.raises(ValueError, match="not valid UTF-8"):
        tok.encode(b"\xff\xfe broken")
    with pytest.raises(TypeError, match="takes text"):
        tok.encode(12345)
