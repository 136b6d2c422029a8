"""Streamed prefill computes the same function as the cached path and the reference,
leaves the decode cache alone, and reports what it sent."""

import numpy as np
import pytest

import ftjax
import hf_models
from ftjax.engine.streamed import stream_threshold

PROMPT = [int(t) for t in np.random.RandomState(3).randint(0, 96, size=40)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = hf_models.save(hf_models.build("qwen3_moe", seed=21), tmp_path_factory.mktemp("streamed"))
    ref = ftjax.load(path)
    return path, ref.logits(PROMPT), ref.generate(PROMPT, 8)


@pytest.mark.parametrize("policy,kw", [("lru", dict(cache_slots=5, bandwidth=(1.0, 2.0))),
                                       ("static-layer", dict(cache_slots=6))])
def test_streamed_equals_reference(setup, policy, kw):
    path, ref_logits, ref_tokens = setup
    model = ftjax.load(path, policy=policy, prefill="streamed", **kw)
    model.generate(PROMPT[:5], 3)  # some experts become resident (lru): they must not be resent
    before = {k: np.asarray(v) for k, v in model._xstate.items() if k != "cache"}
    model.reset_stats()
    logits = model.logits(PROMPT)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5 * np.abs(ref_logits).max(), rtol=0)
    after = {k: np.asarray(v) for k, v in model._xstate.items() if k != "cache"}
    assert all(np.array_equal(before[k], after[k]) for k in before)  # decode cache untouched
    log, s = model.expert_log(), model.stats()
    assert {r["phase"] for r in log} == {"prefill"}
    assert s["hits"] + s["misses"] == s["selections"] and s["fetched"] == s["host_computed"] == 0
    assert s["streamed"] + s["hits"] == s["selections"]
    assert s["bytes_streamed"] > 0
    for r in log:  # resident experts came from the cache, everything else from the block
        assert sorted(r["hits"] + r["streamed"]) == r["selected"]
    assert model.generate(PROMPT, 8) == ref_tokens  # decode continues from the streamed KV cache


def test_auto_threshold(setup):
    path, *_ = setup
    model = ftjax.load(path, policy="host", prefill="auto", prefill_stream_threshold=30)
    assert not model.streams(29) and model.streams(30)
    model.generate(PROMPT[:10], 2)
    assert not model.expert_log()[0]["streamed"]
    model.reset_stats()
    model.generate(PROMPT, 2)
    assert model.expert_log()[0]["streamed"]
    assert stream_threshold(128, 8) == 36 and stream_threshold(4, 4) == 1
    assert not ftjax.load(path).streams(10_000)  # policy "device": nothing to stream


def test_prefill_breakdown(setup):
    path, *_ = setup
    model = ftjax.load(path, policy="host")
    b = model.prefill_breakdown(PROMPT)
    assert b["t_prefill_s"] > 0 and b["t_transfer_s"] > 0 and b["t_compute_s"] > 0
    assert b["bytes_sent"] == model.config.num_moe_layers * model.config.num_experts * model.checkpoint.pool.expert_bytes
    with pytest.raises(ValueError, match="nothing to stream"):
        ftjax.load(path).prefill_breakdown(PROMPT)


def test_calibrate_prefill_measures_a_threshold(setup):
    path, *_ = setup
    model = ftjax.load(path, policy="lru-host-only", cache_slots=4)
    result = model.calibrate_prefill(max_tokens=32, repeats=1)
    assert [b["tokens"] for b in result["buckets"]] == [16, 32]
    assert all(b["cached_s"] > 0 and b["streamed_s"] > 0 for b in result["buckets"])
    assert model.stream_threshold == result["threshold"] in (16, 32, model.max_seq_len)
    assert model.stats()["selections"] == 0 and model.expert_log() == []  # calibration leaves no records
