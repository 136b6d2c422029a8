"""Streamed prefill computes the same function as the cached path and the reference,
leaves the decode cache alone, and reports what it sent."""

import numpy as np
import pytest

import ftjax
import hf_models
from ftjax.bench.prefill import calibrate_prefill, prefill_breakdown
from ftjax.engine.streamed import stream_threshold
from ftjax.model import streams

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
    resident = int((before["slot_of"] >= 0).sum())
    assert resident > 0
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
    # exactly the non-resident experts crossed the link, nothing else
    cfg = model.config
    assert s["bytes_streamed"] == (cfg.num_moe_layers * cfg.num_experts - resident) * model.checkpoint.pool.expert_bytes
    for r in log:  # resident experts came from the cache, everything else from the block
        assert sorted(r["hits"] + r["streamed"]) == r["selected"]
    assert model.generate(PROMPT, 8) == ref_tokens  # decode continues from the streamed KV cache


def test_auto_threshold(setup):
    path, *_ = setup
    # on an accelerator, "auto" streams from the threshold on
    assert not streams("auto", 30, 29, device_is_host=False) and streams("auto", 30, 30, device_is_host=False)
    assert streams("streamed", 30, 1, device_is_host=True) and not streams("cached", 30, 10**6, device_is_host=False)
    # where the device is the host (this CPU backend), "auto" never streams: the host
    # kernels read the pool in place and a "transfer" would copy RAM to RAM
    model = ftjax.load(path, policy="host", prefill="auto", prefill_stream_threshold=30)
    assert not model.streams(30) and not model.streams(10_000)
    model.generate(PROMPT, 2)
    assert not model.expert_log()[0]["streamed"] and model.stats()["bytes_streamed"] == 0
    streaming = ftjax.load(path, policy="host", prefill="streamed")
    streaming.generate(PROMPT, 2)
    assert streaming.expert_log()[0]["streamed"]
    assert stream_threshold(128, 8) == 36 and stream_threshold(4, 4) == 1
    assert not ftjax.load(path).streams(10_000)  # policy "device": nothing to stream


def test_prefill_breakdown(setup):
    path, *_ = setup
    model = ftjax.load(path, policy="host")
    b = prefill_breakdown(model, PROMPT)
    assert b["t_prefill_s"] > 0 and b["t_transfer_s"] > 0 and b["t_compute_s"] > 0
    assert b["bytes_sent"] == model.config.num_moe_layers * model.config.num_experts * model.checkpoint.pool.expert_bytes
    with pytest.raises(ValueError, match="nothing to stream"):
        prefill_breakdown(ftjax.load(path), PROMPT)


def test_calibrate_prefill_measures_a_threshold(setup):
    path, *_ = setup
    model = ftjax.load(path, policy="lru-host-only", cache_slots=4)
    result = calibrate_prefill(model, max_tokens=32, repeats=1)
    assert [b["tokens"] for b in result["buckets"]] == [16, 32]
    assert all(b["cached_s"] > 0 and b["streamed_s"] > 0 for b in result["buckets"])
    assert model.stream_threshold == result["threshold"] in (16, 32, model.max_seq_len)
    assert model.stats()["selections"] == 0 and model.expert_log() == []  # calibration leaves no records
