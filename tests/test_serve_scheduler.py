"""The continuous-batching scheduler in process: rows joining and leaving a running batch
get exactly what a lone `Model.generate` gives them; cancellation and forced / banned
tokens act within one step."""

import numpy as np
import pytest

import ftjax
from ftjax.engine.scheduler import Job, Scheduler, batch_buckets, capacity_buckets
from ftjax.engine.session import Sampling

TEXTS = ["It is a truth universally acknowledged", "To be, or not to be", "In the beginning God created",
         "Emma Woodhouse, handsome, clever, and rich", "Call me", "The king"]


@pytest.fixture(scope="module")
def model():
    return ftjax.load()


def _job(prompt, n, sampling, log, **kw):
    out = log.setdefault(len(log), {"tokens": [], "done": None})
    return Job(np.asarray(prompt, np.int32), n, sampling, on_token=lambda t: out["tokens"].append(t) and False,
               on_done=lambda r: out.update(done=r), **kw), out


def test_buckets():
    assert batch_buckets(4) == [1, 2, 4] and batch_buckets(6) == [1, 2, 4, 6] and batch_buckets(1) == [1]
    assert capacity_buckets(2048) == [128, 512, 2048] and capacity_buckets(100) == [100]
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)


def test_joining_rows_match_generate(model):
    prompts = [model.tokenizer.encode(t) for t in TEXTS]
    settings = [Sampling() if i % 2 else Sampling(0.9, 0, 0.95, seed=i) for i in range(len(prompts))]
    lengths = [12, 20, 7, 16, 25, 9]
    want = [model.generate(p, n, s.temperature, s.top_k, s.top_p, s.seed) for p, n, s in
            zip(prompts, lengths, settings)]
    sch, log, outs = Scheduler(model, max_batch=4, prefill_chunk=4), {}, []
    for i, (p, n, s) in enumerate(zip(prompts, lengths, settings)):
        job, out = _job(p, n, s, log)
        outs.append(out)
        sch.submit(job)
        for _ in range(3):  # later requests arrive while earlier ones decode
            sch.step()
            assert sum(r is not None for r in sch._rows) <= 4
    while sch.busy():
        sch.step()
    assert [o["tokens"] for o in outs] == want
    assert all(o["done"] in ("length", "eos") for o in outs)
    stats = sch.stats()
    assert stats["peak_active"] == 4 and stats["active"] == 0 and stats["batch_rows"] == 0


def test_cancel_forced_and_banned(model):
    prompt = model.tokenizer.encode(TEXTS[0])
    after = model.generate(prompt + [7, 8], 4)[0]  # what follows the forced tokens, unbanned
    sch, log = Scheduler(model, max_batch=2), {}
    a, out_a = _job(prompt, 500, Sampling(), log)
    b, out_b = _job(prompt, 6, Sampling(), log, forced=[7, 8], banned=frozenset([after]))
    sch.submit(a)
    sch.submit(b)
    for _ in range(6):
        sch.step()
    sch.cancel(a)
    sch.step()
    assert out_a["done"] == "cancelled" and all(r is None or r.job is not a for r in sch._rows)
    while sch.busy():
        sch.step()
    assert out_b["tokens"][:2] == [7, 8] and after not in out_b["tokens"] and len(out_b["tokens"]) == 6
    assert sch.stats()["cancelled"] == 1 and not sch.busy()


def test_a_prefill_alone_takes_large_chunks_and_one_beside_decoding_rows_small_ones(model, monkeypatch):
    """While no row decodes, a request prefills in chunks of `solo_chunk` (nobody waits on
    the step); beside decoding rows, and for idle work, in chunks of `prefill_chunk`. The
    tokens are a lone generate's either way."""
    from ftjax.engine import session as session_module

    chunks = []
    real_append = session_module.Session.append
    monkeypatch.setattr(session_module.Session, "append",
                        lambda self, ids: chunks.append(len(ids)) or real_append(self, ids))
    exact = ftjax.load(numerics="exact")  # chunking changes no result beyond f32 summation order
    prompts = [[int(t) for t in (np.arange(300) * k + k) % 4000] for k in (3, 5, 7)]  # no common prefix
    want = [exact.generate(p, 6) for p in prompts[:2]]
    from ftjax.engine.state_cache import StateCache

    sch, log = Scheduler(exact, max_batch=2, prefill_chunk=64, state_cache=StateCache(exact, "prefix", 256 << 20, 0)), {}
    assert sch.solo_chunk == 2048
    chunks.clear()
    a, out_a = _job(prompts[0], 6, Sampling(), log)
    sch.submit(a)
    sch.step()
    assert chunks == [300]  # alone: one chunk
    chunks.clear()
    b, out_b = _job(prompts[1], 6, Sampling(), log)
    sch.submit(b)
    while sch.busy():
        sch.step()
    assert chunks == [64, 64, 64, 64, 44]  # beside a decoding row
    assert [out_a["tokens"], out_b["tokens"]] == want
    chunks.clear()
    sch.idle_grace_s = 0.0
    assert sch.submit_idle(np.asarray(prompts[2], np.int32))
    while sch.busy():
        sch.step()
    assert len(chunks) >= 5 and max(chunks) == 64  # idle work: small chunks, so that a request waits little
