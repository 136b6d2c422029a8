"""Tokenizer: Hugging Face ``tokenizer.json`` + chat template, without transformers.

Purpose: everything the runtime needs to turn chats into ids and ids back into text for
any model folder (Qwen, Mixtral, OLMoE, the embedded default model), with the exact
strings transformers would produce, but only ``tokenizers`` and ``jinja2`` as
dependencies.

Design:
- ``Tokenizer.from_dir`` reads a model folder the way ``AutoTokenizer`` does:
  ``tokenizer.json`` (the whole pipeline: pre-tokenizer, BPE, added tokens, decoder),
  ``tokenizer_config.json`` (named special tokens, chat template), ``chat_template.jinja``
  and ``chat_templates/*.jinja`` (which win over the config's template, as in
  transformers >= 4.43), and the eos ids of ``generation_config.json`` / ``config.json``.
  A chat ends at any id in ``eos_token_ids`` (Qwen stops on ``<|im_end|>`` *and*
  ``<|endoftext|>``, which only the union of the three files gives).
- ``apply_chat_template`` mirrors ``transformers.utils.chat_template_utils``: an
  immutable sandboxed jinja2 environment with ``trim_blocks``/``lstrip_blocks``,
  ``loopcontrols``, a no-op ``{% generation %}`` tag, the ``raise_exception`` and
  ``strftime_now`` globals, a ``tojson`` filter that does not HTML-escape, messages with
  ``None`` values dropped, reasoning aliased to ``reasoning_content``/``thinking``, and the
  named special tokens (``bos_token``, ``eos_token``, ...) as template variables.
- ``decode`` is ``tokenizers``' decode; ``clean_up_tokenization_spaces`` is not applied
  (transformers ignores it for BPE models too, which is every MoE LLM we target).
- ``StreamDecoder`` streams text one id at a time with the prefix/read-offset scheme of
  text-generation-inference: decode a short window twice (with and without the new ids)
  and emit the difference once it no longer ends in U+FFFD, i.e. once byte-level BPE
  has delivered every byte of the last character. Decoding a window that starts at an
  earlier token keeps decoders that strip a leading space (Metaspace) consistent.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["StreamDecoder", "Tokenizer"]

# Named special-token attributes that transformers passes to chat templates.
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed JSON in {path}: {e}") from e


def _token_str(value: Any) -> str | None:
    # tokenizer_config.json stores a special token as a string or as a serialized AddedToken.
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


# ---------------------------------------------------------------------------- chat templates


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers uses it for masks)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    # As in transformers: namespaces refuse underscore attributes (no route to CPython internals).
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Unlike jinja2's own tojson: no HTML escaping, and json.dumps' options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # `dict(...)` for templates without handing them the dict type itself (no type-hackery).
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def _check_messages(messages: Any) -> list[dict]:
    """Validate and normalize a chat the way transformers does before rendering."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(
            f"messages must be a non-empty list of dicts with 'role' and 'content', got {type(messages).__name__}"
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} has no string 'role': {dict(m)!r}")
        # An assistant turn that only calls tools may leave content out (OpenAI style).
        if "content" not in m and not m.get("tool_calls"):
            raise ValueError(f"message {i} has no 'content': {dict(m)!r}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _load_chat_templates(path: Path, config: Mapping) -> dict[str, str]:
    """Named templates; standalone .jinja files take priority over tokenizer_config.json."""
    templates: dict[str, str] = {}
    main = path / "chat_template.jinja"
    if main.is_file():
        templates["default"] = main.read_text(encoding="utf-8")
    extra = path / "chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if templates:
        return templates
    tpl = config.get("chat_template")
    if isinstance(tpl, str):
        return {"default": tpl}
    if isinstance(tpl, list):  # older format: [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in tpl if isinstance(t, Mapping)}
    return {}


# ---------------------------------------------------------------------------- tokenizer


class Tokenizer:
    """A model folder's tokenizer: encode/decode, special ids, chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: Mapping[str, Any] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        extra_eos_ids: Iterable[int] = (),
        name: str = "<memory>",
    ) -> None:
        self.backend = backend
        self.config = dict(config or {})
        self.chat_templates = dict(chat_templates or {})
        self.name = name
        self.special_tokens_map = {
            attr: tok for attr in _NAMED_SPECIAL if (tok := _token_str(self.config.get(attr))) is not None
        }
        self.bos_token_id = self._named_id("bos_token")
        self.pad_token_id = self._named_id("pad_token")
        eos = {self._named_id("eos_token"), *extra_eos_ids} - {None}
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        added = backend.get_added_tokens_decoder()
        # All added tokens (each always one id) and those flagged special (dropped by decode).
        self.added_token_ids: dict[str, int] = {t.content: i for i, t in sorted(added.items())}
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and its companions from a model folder."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model folder {path}")
        _read_json(tok_file)  # a precise error for broken JSON; tokenizers' own is terse
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception for schema errors
            raise ValueError(f"cannot load {tok_file}: {e}") from e
        config_file = path / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        if not isinstance(config, Mapping):
            raise ValueError(f"{config_file} must hold a JSON object")
        eos_ids: list[int] = []
        for fname in ("generation_config.json", "config.json"):
            f = path / fname
            if f.is_file():
                data = _read_json(f)
                if isinstance(data, Mapping):
                    eos_ids += _as_id_list(data.get("eos_token_id"))
        return cls(backend, config, _load_chat_templates(path, config), eos_ids, name=str(path))

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"

    # -- vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of token ids including added tokens (a model's embedding may be padded larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _named_id(self, attr: str) -> int | None:
        tok = self.special_tokens_map.get(attr)
        return None if tok is None else self.backend.token_to_id(tok)

    # -- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of ``text``; special tokens written in the text map to their single ids."""
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"prompt bytes are not valid UTF-8 ({e})") from None
        if not isinstance(text, str):
            raise TypeError(f"encode takes text (str), got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    # -- chat

    def chat_template(self, tools: Any = None) -> str:
        """The template source used for a chat (``tool_use`` when tools are given and it exists)."""
        t = self.chat_templates
        if tools is not None and "tool_use" in t:
            return t["tool_use"]
        if "default" in t:
            return t["default"]
        if len(t) == 1:
            return next(iter(t.values()))
        which = f" named 'default' (has {sorted(t)})" if t else ""
        raise ValueError(f"tokenizer {self.name} has no chat template{which}")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a chat to the prompt string, identical to transformers' ``tokenize=False`` output.

        ``tools`` are JSON-schema dicts; extra keyword arguments (``enable_thinking``,
        ``documents``, ...) become template variables and override the special tokens.
        """
        chat = _check_messages(messages)
        if tools is not None:
            if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools):
                raise ValueError("tools must be a list of JSON-schema dicts")
            tools = [dict(t) for t in tools]
        template = _compile_template(self.chat_template(tools))
        variables = {**self.special_tokens_map, **kwargs}
        variables.setdefault("documents", None)
        return template.render(messages=chat, tools=tools, add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """``encode(apply_chat_template(...))``: the template already holds any bos/eos it wants."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs))


class StreamDecoder:
    """Incremental detokenizer: ``push`` ids one at a time, get text once it is complete UTF-8.

    The concatenation of every ``push`` result and the final ``flush`` equals
    ``tokenizer.decode(all_ids)``. Only a short window of ids is re-decoded per step.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0  # window start: decoded text up to _read_offset was emitted
        self._read_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text ("" while a character is still partial)."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        text = self._decode(self.ids[self._prefix_offset :])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            return text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (invalid trailing bytes come out as U+FFFD, as in decode)."""
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        text = self._decode(self.ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.ids)
        return text[len(prefix_text) :]

    def stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Yield non-empty text pieces for ``ids``, then the flushed remainder."""
        for i in ids:
            if piece := self.push(i):
                yield piece
        if rest := self.flush():
            yield rest
