"""Routing traces of real runs: greedy decode of held-out text, and an agent-style chat.

    held-out text (corpus.split(name)[1]) --prompt windows--> Model.generate (greedy)
    chat with <think> / <tool_call> / <tool_output> blocks --chat template--> one generation per assistant turn
        --> Model.expert_log() --> lab.Trace (.npz; prefill + decode records)

The model runs with policy "device" (every expert resident), so the log is pure
routing: one record per (step, MoE layer), a decode record being one generated
token through one MoE layer. Nothing is teacher-forced: every decode record comes
from a generation step the model chose itself.

Every generation uses the same KV-cache length (`cache_len`): `generate_stream`
sizes its cache from prompt + max_new_tokens, so asking for cache_len - T tokens and
stopping after our own budget keeps one compiled decode step for the whole run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ftjax.data import corpus
from ftjax.lab.trace import Trace

Log = Callable[[str], None]


@dataclass
class Generation:
    tokens: list[int]
    token_s: list[float]  # wall time of each decode step (tokens[1:]), seconds
    ttft_s: float


def generate(model, ids: Sequence[int], num_tokens: int, cache_len: int) -> Generation:
    """Greedy tokens (up to num_tokens, fewer on EOS) with the per-token wall times.

    Fixes the KV length at cache_len (one compile for every prompt and budget)."""
    ids = list(ids)
    if len(ids) + num_tokens > cache_len:
        raise ValueError(f"prompt {len(ids)} + {num_tokens} tokens do not fit cache_len {cache_len}")
    stream = model.generate_stream(ids, cache_len - len(ids))
    tokens, stamps = [], []
    start = time.perf_counter()
    try:
        for tok in stream:
            stamps.append(time.perf_counter())
            tokens.append(tok)
            if len(tokens) >= num_tokens:
                break
    finally:
        stream.close()
    return Generation(tokens, np.diff(stamps).tolist(), stamps[0] - start if stamps else 0.0)


def trace_of(model, meta: dict) -> Trace:
    """The model's expert log as a Trace (streamed prefill records dropped: they bypass the cache)."""
    cfg = model.config
    log = [r for r in model.expert_log() if not r.get("streamed")]
    return Trace.from_records(log, cfg.num_moe_layers, cfg.num_experts, meta=meta)


def text_prompts(tokenizer, name: str, num_prompts: int, prompt_tokens: int, skip: int = 0) -> list[list[int]]:
    """Windows of prompt_tokens ids, evenly spaced over the held-out tail of text `name`.

    skip: leave out the first `skip` windows of that spacing (for a prompt no trace used)."""
    valid = corpus.split(name)[1]
    ids = tokenizer.encode(valid)
    total = num_prompts + skip
    stride = max(prompt_tokens, (len(ids) - prompt_tokens) // max(total, 1))
    starts = [i * stride for i in range(total) if i * stride + prompt_tokens <= len(ids)]
    if len(starts) < total:
        raise ValueError(f"held-out text {name!r} has {len(ids)} tokens: too short for {total} prompts")
    return [ids[s : s + prompt_tokens] for s in starts[skip:]]


def record_text_trace(model, name: str, *, num_prompts: int, prompt_tokens: int, decode_tokens: int,
                      cache_len: int) -> Trace:
    """Greedy continuations of `num_prompts` held-out windows of text `name`, one trace."""
    model.reset_stats()
    made = 0
    for prompt in text_prompts(model.tokenizer, name, num_prompts, prompt_tokens):
        made += len(generate(model, prompt, decode_tokens, cache_len).tokens)
    return trace_of(model, {"kind": "text", "text": name, "prompts": num_prompts,
                            "prompt_tokens": prompt_tokens, "new_tokens": made})


# ---------------------------------------------------------------------------- agent chat

SYSTEM = ("You are a research assistant for old books. Think inside <think></think>, "
          "call a tool when you need a passage, then answer briefly.")
TOOLS = [
    {"type": "function", "function": {
        "name": "search_books", "description": "Full-text search over the library.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "read_passage", "description": "Return a passage of a book.",
        "parameters": {"type": "object", "properties": {"book": {"type": "string"}, "offset": {"type": "integer"}},
                       "required": ["book", "offset"]}}},
]
QUESTIONS = [
    "Who speaks first in the last chapter, and what do they want?",
    "Find a passage about a journey and tell me where it ends.",
    "Compare how the two books describe a king.",
    "Which character changes their mind, and why?",
    "Quote a line about the sea and explain it.",
    "Summarise what we found so far in two sentences.",
]


def _passage(name: str, k: int, chars: int = 320) -> tuple[int, str]:
    valid = corpus.split(name)[1]
    offset = (k * 7919 * chars) % max(1, len(valid) - chars)
    return offset, " ".join(valid[offset : offset + chars].split())


def record_chat_trace(model, *, texts: Sequence[str], turns: int, turn_tokens: int, cache_len: int,
                      log: Log = lambda m: None) -> Trace:
    """A multi-turn tool-using chat: each assistant turn is generated (after an opening
    <think>), then recorded as reasoning + a scripted tool call, and answered by a tool
    message (<tool_output>) holding a held-out passage. The final turn answers directly."""
    tok = model.tokenizer
    model.reset_stats()
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    made, prompt_lens = 0, []
    for turn in range(turns):
        if turn % 2 == 0:
            messages.append({"role": "user", "content": QUESTIONS[(turn // 2) % len(QUESTIONS)]})
        last = turn == turns - 1
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tools=TOOLS)
        ids = tok.encode(prompt + ("" if last else "<think>\n"))
        if len(ids) + turn_tokens > cache_len:
            log(f"chat: stopping after {turn} turns (prompt {len(ids)} tokens would not fit {cache_len})")
            break
        prompt_lens.append(len(ids))
        new = generate(model, ids, turn_tokens, cache_len).tokens
        made += len(new)
        text = tok.decode(new).split("</think>")[0].strip()
        if last:
            messages.append({"role": "assistant", "content": text})
            break
        book = texts[turn % len(texts)]
        offset, passage = _passage(book, turn)
        call = ({"name": "read_passage", "arguments": {"book": book, "offset": offset}} if turn % 2 == 0
                else {"name": "search_books", "arguments": {"query": " ".join(passage.split()[:4])}})
        messages.append({"role": "assistant", "reasoning_content": text or "...", "content": "",
                         "tool_calls": [{"type": "function", "function": call}]})
        messages.append({"role": "tool", "content": passage})
    return trace_of(model, {"kind": "chat", "turns": len(prompt_lens), "prompt_tokens": prompt_lens,
                            "new_tokens": made, "transcript": tok.apply_chat_template(messages, False, tools=TOOLS)})


def concat(traces: Sequence[Trace], meta: dict | None = None) -> Trace:
    """One trace holding the records of several (same model), steps renumbered to stay unique."""
    records, offset = [], 0
    for t in traces:
        for r in t.records():
            records.append({**r, "step": r["step"] + offset})
        offset += int(t.step.max()) + 1 if len(t) else 0
    first = traces[0]
    return Trace.from_records(records, first.num_layers, first.num_experts, meta=meta or {})


def locality(trace: Trace, seed: int = 0) -> dict:
    """Temporal locality of decode routing: the share of a layer's experts at token t that
    it also selected at token t-1, against chance (same tokens, order shuffled per layer)."""
    decode = trace.decode_only()
    if not len(decode):
        return {"decode_tokens": 0, "reuse": float("nan"), "chance": float("nan"), "selections": 0}
    rng = np.random.default_rng(seed)
    by_layer: dict[int, list[np.ndarray]] = {}
    for _, layer, _, sel in decode.rows():
        by_layer.setdefault(layer, []).append(sel)

    def reuse(seqs):
        kept = sum(len(np.intersect1d(a, b, assume_unique=True)) for a, b in zip(seqs[1:], seqs[:-1]))
        return kept, sum(len(b) for b in seqs[:-1])

    real = [reuse(s) for s in by_layer.values()]
    shuffled = [reuse([s[i] for i in rng.permutation(len(s))]) for s in by_layer.values()]
    ratio = lambda pairs: sum(k for k, _ in pairs) / max(1, sum(n for _, n in pairs))  # noqa: E731
    return {"decode_tokens": len(set(decode.step.tolist())), "selections": decode.num_selections,
            "reuse": ratio(real), "chance": ratio(shuffled)}


def prefill_coverage(trace: Trace) -> list[dict]:
    """Per prefill step: share of each layer's experts the prompt's tokens selected (mean over layers)."""
    pre = trace.filter("prefill")
    out = []
    for step in dict.fromkeys(pre.step.tolist()):
        rows = np.flatnonzero(pre.step == step)
        sizes = np.diff(pre.offsets)[rows]
        out.append({"step": int(step), "coverage": float(sizes.mean() / trace.num_experts)})
    return out


def zipf_exponent(trace: Trace) -> float:
    """Least-squares s of frequency ~ (1 + rank)^-s per layer (decode records), averaged."""
    decode = trace.decode_only()
    counts = np.bincount(decode.flat_ids(), minlength=trace.num_layers * trace.num_experts)
    slopes = []
    for layer_counts in counts.reshape(trace.num_layers, trace.num_experts):
        f = np.sort(layer_counts)[::-1].astype(float)
        ok = f > 0
        if ok.sum() < 3:
            continue
        x, y = np.log1p(np.arange(len(f)))[ok], np.log(f[ok])
        slopes.append(-np.polyfit(x, y, 1)[0])
    return float(np.clip(np.mean(slopes), 0.0, 3.0)) if slopes else 1.0
