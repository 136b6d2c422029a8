"""`ftjax bench agent`: the synthetic agent transcripts (deterministic, 10+ requests, the
three history rewrites, rendered by the default model's chat template, convertible to
the Anthropic Messages API) and the summary arithmetic; one slow end-to-end run
against a real `ftjax serve`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ftjax
from ftjax.bench.agent import idle_work, memory_series, mode_support, summarize, verdicts
from ftjax.data import agent_transcripts as at
from ftjax.serve import anthropic_api

NAMES = at.names()
CONTEXT = 2048  # the embedded model's


@pytest.fixture(scope="module")
def model():
    return ftjax.load()


def _assistants(messages):
    return [m for m in messages if m["role"] == "assistant"]


def test_deterministic_and_json():
    a, b = at.workloads(), at.workloads()
    assert a == b and set(a) == {"coding", "assistant"}
    assert json.loads(json.dumps(a)) == a
    assert at.workloads(2.0) != a  # scale changes the long parts
    for reqs in a.values():
        assert all(all(ord(c) < 128 for c in json.dumps(r)) for r in reqs)  # plain ASCII


@pytest.mark.parametrize("name", NAMES)
def test_ten_plus_turns_of_growing_history(name):
    w = at.build(name)
    reqs = w.requests()
    assert len(reqs) >= 10
    assert len(w.tools) >= 3
    for i, r in enumerate(reqs):
        assert r[0] == {"role": "system", "content": w.system}
        assert r[-1]["role"] in ("user", "tool")
        if i:
            assert len(r) > len(reqs[i - 1])
    roles = {m["role"] for r in reqs for m in r}
    assert roles == {"system", "user", "assistant", "tool"}
    # every tool message answers a call made earlier in the same request
    for r in reqs:
        calls = {c["id"] for m in _assistants(r) for c in m.get("tool_calls", [])}
        assert all(m["tool_call_id"] in calls for m in r if m["role"] == "tool")
    assert all("reasoning_content" in s.reply for s in w.steps)  # scripted replies all reason


def test_reasoning_of_old_turns_dropped():
    coding, assistant = at.build("coding"), at.build("assistant")
    for i, r in enumerate(coding.requests()):
        with_reasoning = [k for k, m in enumerate(_assistants(r)) if "reasoning_content" in m]
        assert with_reasoning == ([len(_assistants(r)) - 1] if i else [])  # only the latest keeps it
    for r in assistant.requests():
        assert not any("reasoning_content" in m for m in r)  # none keeps it


@pytest.mark.parametrize("name", NAMES)
def test_old_tool_outputs_trimmed(name):
    w = at.build(name)
    reqs = w.requests()
    first = {}  # tool_call_id -> (request it arrived in, its full output)
    trimmed = 0
    for i, r in enumerate(reqs):
        for m in (m for m in r if m["role"] == "tool"):
            k, full = first.setdefault(m["tool_call_id"], (i, m["content"]))
            if i - k < w.trim_after or len(full.split("\n")) <= w.trim_lines + 1:
                assert m["content"] == full  # recent or short: as it came
                continue
            trimmed += 1
            kept, mark = m["content"].split("\n")[:-1], m["content"].split("\n")[-1]
            assert kept == full.split("\n")[: w.trim_lines] and mark.startswith(at.TRIM_MARK)
            assert len(m["content"]) < len(full)
    assert trimmed >= 5


@pytest.mark.parametrize("name", NAMES)
def test_one_call_reechoed_differently(name):
    w = at.build(name)
    reqs = w.requests()
    before, after = _assistants(reqs[w.echo_at - 1])[w.echo_of], _assistants(reqs[w.echo_at])[w.echo_of]
    a, b = before["tool_calls"][0], after["tool_calls"][0]
    assert a["id"] == b["id"] and a["function"]["name"] == b["function"]["name"]
    assert a["function"]["arguments"] != b["function"]["arguments"]  # textually different ...
    assert json.loads(a["function"]["arguments"]) == json.loads(b["function"]["arguments"])  # ... same call
    changed = [(i, k) for i in range(1, len(reqs)) for k, m in enumerate(_assistants(reqs[i - 1]))
               if m.get("tool_calls") and _assistants(reqs[i])[k]["tool_calls"] != m["tool_calls"]]
    assert changed == [(w.echo_at, w.echo_of)]  # exactly one re-echo, once


@pytest.mark.parametrize("name", NAMES)
def test_renders_with_default_template_within_context(model, name):
    w = at.build(name)
    tok = model.tokenizer
    for i, r in enumerate(w.requests()):
        text = tok.apply_chat_template(r, add_generation_prompt=True, tools=w.tools)
        assert text.endswith("<|im_start|>assistant\n") and w.tools[0]["function"]["name"] in text
        assert text.count("<think>") == (1 if w.reasoning == "latest" and i else 0)
        assert len(tok.encode(text)) <= CONTEXT - 16, (name, i)
    # the re-echoed call reaches the prompt text
    r = w.request(w.echo_at)
    args = _assistants(r)[w.echo_of]["tool_calls"][0]["function"]["arguments"]
    assert args in tok.apply_chat_template(r, tools=w.tools)


@pytest.mark.parametrize("name", NAMES)
def test_anthropic_form(model, name):
    w = at.build(name)
    tools = at.anthropic_tools(w.tools)
    for i, r in enumerate(w.requests()):
        system, msgs = at.to_anthropic(r)
        assert system == w.system
        assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(msgs) // 2) + ["user"] * (len(msgs) % 2)
        uses = {b["id"] for m in msgs for b in m["content"] if b["type"] == "tool_use"}
        assert all(b["tool_use_id"] in uses for m in msgs for b in m["content"] if b["type"] == "tool_result")
        # what the server makes of it: the same chat (before the re-echo, the same prompt text)
        body = {"model": "m", "max_tokens": 8, "system": system, "messages": msgs, "tools": tools}
        req = anthropic_api.MessagesRequest.model_validate(json.loads(json.dumps(body)))
        chat = [{"role": "system", "content": system}] + [t for m in req.messages for t in anthropic_api._turn(m)]
        assert [m["role"] for m in chat] == [m["role"] for m in r]
        text = model.tokenizer.apply_chat_template(chat, tools=w.tools)
        if i < w.echo_at:
            assert text == model.tokenizer.apply_chat_template(r, tools=w.tools)


def test_scale_and_bad_names():
    small, big = at.build("assistant", 0.5), at.build("assistant", 3.0)
    assert len(big.system) > len(small.system) and len(big) == len(small)
    with pytest.raises(ValueError):
        at.build("nope")
    with pytest.raises(ValueError):
        at.build("coding", 0)


@pytest.mark.parametrize("name", at.names())
def test_concurrent_sessions_differ_only_in_their_system_prompt(name):
    w = at.build(name, 0.5)
    assert w.for_session(0) is w
    a, b = w.for_session(1).requests(), w.for_session(2).requests()
    assert a[0][0]["content"] != b[0][0]["content"] != w.requests()[0][0]["content"]
    for ra, rb, rw in zip(a, b, w.requests()):
        assert ra[1:] == rb[1:] == rw[1:]


def test_bench_agent_refuses_bad_session_counts():
    from ftjax.bench import main_bench

    for flag in ("--agents", "--max-batch"):
        assert main_bench(["agent", "--out", "/nonexistent", flag, "0", "--allow-dirty"]) == 2


def _rec(mode, ttft, prompt=100, cached=None, workload="coding", error=None):
    return {"mode": mode, "workload": workload, "ttft_s": ttft, "ttft_event": "output", "total_s": ttft,
            "prompt_tokens": prompt, "cached_tokens": cached, "error": error}


def test_summary_and_verdicts():
    recs = [_rec("off", t) for t in (0.1, 0.2, 0.3, 0.4)]
    recs += [_rec("semantic", t, cached=60) for t in (0.1, 0.1, 0.1, 0.2)]
    recs.append(_rec("semantic", None, error="boom"))
    off, sem = summarize(recs, "coding", "off"), summarize(recs, "coding", "semantic")
    assert off["ttft_max_s"] == 0.4 and off["reused_tokens"] is None and off["prefilled_tokens"] == 400
    assert sem["ok"] == 4 and sem["errors"] == 1 and sem["reused_tokens"] == 240 and sem["prefilled_tokens"] == 160
    lines = verdicts([off, sem, summarize(recs, "coding", "prefix")], ["coding"], ["off", "prefix", "semantic"])
    assert lines[0].startswith("coding: prefix vs off: CANNOT TEST")
    assert lines[1] == "coding: semantic vs off: p50 2.50x lower, p95 2.08x lower"
    assert verdicts([off], ["coding"], ["off"]) == ["only one mode (or no off) was run: no comparison"]
    # the load comparison: idle re-prefill on (reprefill) against off (semantic), no cold run
    rep = summarize([dict(r, mode="reprefill") for r in recs if r["mode"] == "off"], "coding", "reprefill")
    assert verdicts([sem, rep], ["coding"], ["semantic", "reprefill"]) == [
        "coding: reprefill vs semantic: p50 2.50x higher, p95 2.08x higher"]


def test_idle_work_counts_only_between_the_samples():
    before = {"idle_reprefill": {"admitted": 2, "done": 2, "preempted": 0, "dropped": 0, "tokens": 300}}
    after = {"idle_reprefill": {"admitted": 5, "done": 3, "preempted": 1, "dropped": 1, "tokens": 900}}
    assert idle_work(before, after) == {"admitted": 3, "done": 1, "preempted": 1, "dropped": 1, "tokens": 600}
    assert idle_work(None, after) is None and idle_work({"idle_reprefill": None}, after) is None


def test_memory_series_prefers_the_split():
    mib = 2**20
    split = {"t_s": 1.0, "memory_split": {"budget_bytes": 8 * mib, "states_bytes": mib, "expert_slots_active": 3},
             "memory": {"rss_bytes": 99 * mib}, "state_cache": {"bytes": {"device": mib}}}
    bare = {"t_s": 0.5, "memory_split": None, "memory": {"rss_bytes": 2 * mib},
            "state_cache": {"mode": "prefix", "bytes": {"device": mib, "host": 0}}}
    assert memory_series([split]) == {"budget_bytes": [(1.0, 8.0)], "states_bytes": [(1.0, 1.0)],
                                      "state_cache_device_bytes": [(1.0, 1.0)]}
    assert memory_series([bare]) == {"rss_bytes": [(0.5, 2.0)], "state_cache_device_bytes": [(0.5, 1.0)],
                                     "state_cache_host_bytes": [(0.5, 0.0)]}
    split["memory_split"]["state_cache_bytes"] = mib
    assert "state_cache_device_bytes" not in memory_series([split])


def test_mode_support_from_help():
    assert mode_support(["off", "semantic"], "--state-cache {off,prefix,semantic}") == {"off": None, "semantic": None}
    partial = mode_support(["off", "semantic"], "[--state-cache {off,prefix}]")
    assert partial["off"] is None and "no mode 'semantic'" in partial["semantic"]
    old = mode_support(["off", "prefix"], "usage: ftjax serve [--port PORT]")
    assert old["off"] is None and "no --state-cache" in old["prefix"]


@pytest.mark.slow
def test_end_to_end_quick_off(tmp_path):
    out = tmp_path / "agent"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "ftjax.cli", "bench", "agent", "--out", str(out), "--quick",
                        "--modes", "off", "--no-warmup", "--allow-dirty"], capture_output=True, text=True, env=env, timeout=600,
                       cwd=Path(__file__).parents[1])
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["modes"] == {"off": "ok"} and summary["errors"] == 0
    for name in ("agent.json", "agent.md", "server-off.log"):
        assert (out / name).is_file(), name
    for png in ("ttft.png", "memory.png"):
        assert (out / png).stat().st_size > 1000, png
    doc = json.loads((out / "agent.json").read_text())
    assert {r["workload"] for r in doc["records"]} == {"coding", "assistant"}
    assert len(doc["records"]) == 6 and doc["commit"]["commit"] and doc["machine"]["cores"]
    for r in doc["records"]:
        assert r["error"] is None and isinstance(r["ttft_s"], float) and 0 < r["ttft_s"] <= r["total_s"]
        assert r["prompt_tokens"] > 100
    assert doc["modes"]["off"]["samples"]  # /v1/stats was polled
    md = (out / "agent.md").read_text()
    assert "| coding | off | 3/3 |" in md and "| assistant | off | 3/3 |" in md
