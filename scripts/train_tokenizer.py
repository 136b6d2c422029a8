"""Train the byte-level BPE tokenizer of the embedded default model.

Usage: python scripts/train_tokenizer.py [--vocab-size 4096] [--out ftjax/default_model]

Design:
- Qwen2/3 layout so the default model exercises the same code paths as real checkpoints:
  no normalizer; pre-tokenizer = Qwen's split regex (single digits, punctuation absorbs the
  newlines after it) then ByteLevel without its own regex; BPE over the 256 byte symbols;
  ByteLevel decoder. The added tokens come last in the id space, as in Qwen.
- Added tokens: ``<|endoftext|>`` (document separator and pad), ``<|im_start|>`` and
  ``<|im_end|>`` (eos) are special (``decode(skip_special_tokens=True)`` drops them);
  ``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``, ``<tool_output>`` and
  ``</tool_output>`` are added but not special, as in Qwen3: each is still always one id
  (prefix caching of agent sessions keys on them), yet they survive decoding so reasoning
  and tool calls can be parsed from the decoded text.
- Trained on the *training* splits of ftjax.data.corpus only (the validation tails are
  where compression is measured). BPE training has no randomness; the text is fed in
  chunks cut after a newline that precedes a non-blank line, which the split regex never
  crosses, so pre-token counts equal those of the whole text and the result does not
  depend on thread count. ``--check`` retrains and compares the files byte for byte.
- Writes tokenizer.json, tokenizer_config.json and chat_template.jinja (the same template
  as tokenizer_config["chat_template"]); prints one JSON line of stats (bytes per token on
  each validation split).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing ftjax

from ftjax.data import corpus  # noqa: E402

# Qwen2/Qwen3 pre-tokenizer regex (GPT-4 style, but one digit per pre-token).
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONTROL_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_output>", "</tool_output>"]

# ChatML, compact. The rendering of a chat is a prefix of the rendering of any extension of
# it (no rewriting of earlier turns, unlike Qwen3 dropping old reasoning), so the KV cache
# of an agent session can be reused turn after turn.
CHAT_TEMPLATE = """\
{%- set system = messages[0].content if messages[0].role == 'system' else none %}
{%- if tools %}
<|im_start|>system
{% if system %}{{ system }}

{% endif %}
# Tools

You may call one or more functions. Their signatures are inside <tools></tools>:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>
To call a function, reply with a JSON object holding "name" and "arguments" inside <tool_call></tool_call>.<|im_end|>
{% elif system is not none %}
<|im_start|>system
{{ system }}<|im_end|>
{% endif %}
{% for message in messages %}
{% if not (loop.first and message.role == 'system') %}
<|im_start|>{{ message.role }}
{% if message.role == 'tool' %}
<tool_output>
{{ message.content }}
</tool_output>
{%- else %}
{% if message.reasoning_content %}
<think>
{{ message.reasoning_content }}
</think>
{% endif %}
{% if message.content is defined %}{{ message.content }}{% endif %}
{% for call in message.tool_calls | default([]) %}
{% set fn = call.function if call.function is defined else call %}
{% if message.content or not loop.first %}

{% endif %}
<tool_call>
{"name": {{ fn.name | tojson }}, "arguments": {{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}}
</tool_call>
{%- endfor %}
{% endif %}
<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""


def chunks(text: str) -> list[str]:
    """Cut after each newline that precedes a non-blank line: never inside a pre-token."""
    return re.split(r"(?<=\n)(?=\S)", text)


def build(vocab_size: int) -> Tokenizer:
    num_added = len(SPECIAL_TOKENS) + len(CONTROL_TOKENS)
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_added,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    texts = [piece for name in corpus.names() for piece in chunks(corpus.split(name)[0])]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens([t for t in CONTROL_TOKENS])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def tokenizer_config(max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write(tok: Tokenizer, out: Path, max_length: int) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(tokenizer_config(max_length), indent=2, ensure_ascii=False) + "\n",
        "chat_template.jinja": CHAT_TEMPLATE,
    }
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    return [out / n for n in files]


def stats(tok: Tokenizer) -> dict:
    out = {}
    for name in corpus.names():
        valid = corpus.split(name)[1]
        num_tokens = len(tok.encode(valid).ids)
        out[name] = {
            "valid_bytes": len(valid.encode()),
            "num_valid_tokens": num_tokens,
            "bytes_per_token": round(len(valid.encode()) / num_tokens, 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--max-length", type=int, default=4096, help="model_max_length in tokenizer_config.json")
    ap.add_argument("--out", type=Path, default=REPO / "ftjax" / "default_model")
    ap.add_argument("--check", action="store_true", help="train again and verify the output is identical")
    args = ap.parse_args()

    tok = build(args.vocab_size)
    paths = write(tok, args.out, args.max_length)
    if args.check:
        again = build(args.vocab_size).to_str(pretty=True) + "\n"
        if again != paths[0].read_text(encoding="utf-8"):
            sys.exit("tokenizer training is not deterministic: two runs differ")
    print(json.dumps({"vocab_size": tok.get_vocab_size(), "out": str(args.out), "valid": stats(tok)}))


if __name__ == "__main__":
    main()
