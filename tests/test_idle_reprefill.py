"""Idle-time re-prefill (`ftjax.engine.rewrites`, `Scheduler.submit_idle`, the serving
Engine): the rewrite rule is learned from the requests themselves, its prediction is
prefilled into the state cache while the engine is idle, a request reuses it only on an
exact token match (so outputs never change, right or wrong), and idle work never runs
while requests do."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import ftjax
from ftjax.data import agent_transcripts as transcripts
from ftjax.engine.rewrites import RewriteTracker, Trim
from ftjax.engine.state_cache import StateCache
from ftjax.serve.core import Engine, collect
from ftjax.serve.openai_api import chat_request


def predictions(workload) -> list[tuple[int, bool]]:
    """(request index, whether the prediction made before it was exact) for a replay."""
    tracker, out, requests = RewriteTracker(), [], workload.requests()
    for i, messages in enumerate(requests):
        _, predicted = tracker.observe(messages)
        if predicted is not None and i + 1 < len(requests):
            out.append((i + 1, requests[i + 1][:len(predicted)] == predicted))
    return out


def test_trim_is_learned_from_one_example_and_applied_once():
    text = "\n".join(f"line {i}" for i in range(10))
    trim = Trim.learn(text, transcripts.trim(text, 3))
    assert trim == Trim(3, transcripts.TRIM_MARK + " {dropped} lines]")
    assert trim.apply(text) == transcripts.trim(text, 3) and trim.apply(trim.apply(text)) == trim.apply(text)
    placeholder = Trim.learn(text, transcripts.ELIDED)
    assert placeholder == Trim(0, transcripts.ELIDED) and placeholder.apply("other\ntext") == transcripts.ELIDED
    assert Trim.learn(text, "something else\nentirely") is None


def test_rules_are_learned_from_the_requests_and_predict_the_next_one():
    coding = transcripts.build("coding")
    rewritten = predictions(coding)  # trimmed tool outputs, reasoning dropped, one re-echoed call
    assert sum(ok for _, ok in rewritten) >= 5 and rewritten[-1][1]
    elided = predictions(coding.keep_last_tool_outputs(2))
    assert sum(ok for _, ok in elided) >= 3
    for name in transcripts.names():  # an agent that only appends: nothing to predict, nothing to do
        assert predictions(transcripts.build(name).append_only()) == []


@pytest.fixture(scope="module")
def model():
    return ftjax.load(policy="host", threads=1)


def ask(engine: Engine, messages: list[dict], tools) -> tuple[str, int]:
    """One greedy chat request through the engine -> (its text, prompt tokens it reused)."""
    async def run():
        _, req = chat_request({"model": "m", "messages": messages, "tools": tools, "max_tokens": 6,
                               "temperature": 0}, engine)
        gen = await engine.generate(req)

        async def connected():
            return False
        result = await collect(gen, connected)
        return result.text + "".join(c.arguments for c in result.tool_calls), result.done.cached_tokens
    return asyncio.run(run())


def settle(engine: Engine, timeout_s: float = 120.0) -> None:
    """Wait until the engine has no idle work left (the agent's "tool time")."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = engine.scheduler.stats()
        if not st["idle"]["waiting"] and not st["prefilling"]:
            return
        time.sleep(0.05)
    raise AssertionError("idle work did not finish")


def replay(model, requests, tools, idle: bool, cache: bool = True) -> tuple[list[str], list[int], dict]:
    state_cache = StateCache(model, "prefix", 256 << 20, 0) if cache else None
    engine = Engine(model, "m", max_batch=1, prefill_chunk=128, state_cache=state_cache, idle_reprefill=idle)
    engine.start()
    try:
        texts, reused = [], []
        for messages in requests:
            text, cached = ask(engine, messages, tools)
            texts.append(text)
            reused.append(cached)
            settle(engine)
        return texts, reused, engine.stats()
    finally:
        engine.close()


def test_idle_reprefill_reuses_the_predicted_history_and_never_changes_outputs(model):
    w = transcripts.build("coding", 0.5).keep_last_tool_outputs(2)
    requests = w.requests()[:8]
    cold, _, _ = replay(model, requests, w.tools, idle=False, cache=False)
    prefix_texts, prefix_reused, _ = replay(model, requests, w.tools, idle=False)
    texts, reused, stats = replay(model, requests, w.tools, idle=True)
    assert texts == cold == prefix_texts  # reuse, right or wrong predictions: the same tokens
    idle = stats["idle_reprefill"]
    assert idle["predictions"] >= 3 and idle["token_exact"] >= 2 and idle["tokens_ready"] > 0
    assert stats["sessions"]["idle"]["done"] >= idle["token_exact"] and stats["sessions"]["idle"]["tokens"] > 0
    assert sum(reused) > sum(prefix_reused)  # the predicted histories were there when asked for


def test_a_wrong_prediction_costs_idle_work_only(model):
    """The agent trims old tool outputs for two turns (the rule is learned), then stops
    trimming: the prediction made for the last request is wrong; its idle prefill ran;
    the output equals the cold run's."""
    w = transcripts.build("coding", 0.5)
    requests = w.requests()[:5]
    untrimmed = transcripts.build("coding", 0.5).append_only().request(5)  # the agent changed its mind
    requests.append(untrimmed)
    cold, _, _ = replay(model, requests, w.tools, idle=False, cache=False)
    texts, _, stats = replay(model, requests, w.tools, idle=True)
    assert texts == cold
    assert stats["idle_reprefill"]["token_wrong"] >= 1 and stats["sessions"]["idle"]["tokens"] > 0


def test_idle_work_waits_for_requests_and_yields_to_them(model):
    """While a request decodes, and for IDLE_GRACE_S after, an idle prefill is not
    admitted; one in progress stops at the next chunk when a request arrives (its chunks
    kept in the state cache)."""
    from ftjax.engine.scheduler import Job, Scheduler
    from ftjax.engine.session import Sampling

    cache = StateCache(model, "prefix", 256 << 20, 0)
    sch = Scheduler(model, max_batch=1, prefill_chunk=64, state_cache=cache)
    rng = np.random.RandomState(0)
    long_idle = rng.randint(0, model.config.vocab_size, 600).astype(np.int32)
    ends = []
    job = Job(rng.randint(0, model.config.vocab_size, 20).astype(np.int32), 8, Sampling(), lambda t: False,
              ends.append)
    sch.submit(job)
    sch.step()  # the request is admitted and prefilled
    assert sch.submit_idle(long_idle)
    while job.outcome is None:
        sch.step()
        assert sch.stats()["idle"]["admitted"] == 0  # never while a request runs
    idle_ends = []
    sch._idle[-1].on_done = idle_ends.append
    sch.step()  # within the grace after the request: a next request may come at once
    assert sch.stats()["idle"]["admitted"] == 0 and not sch.busy()
    time.sleep(sch.idle_grace_s)
    assert sch.busy()
    sch.step()  # nothing else to do for the grace: the idle prefill starts (one chunk)
    assert sch.stats()["idle"]["admitted"] == 1 and sch.stats()["prefilling"] == 1
    second = Job(rng.randint(0, model.config.vocab_size, 20).astype(np.int32), 4, Sampling(), lambda t: False,
                 ends.append)
    sch.submit(second)
    while second.outcome is None:
        sch.step()
    assert idle_ends == ["preempted"] and sch.stats()["idle"]["preempted"] == 1
    assert 0 < cache.lookup(long_idle) < long_idle.size  # the chunks done are in the state cache
    assert ends == ["length", "length"]
