"""The scheduler never loses a job and recovers from any failed step, in process.

- Requests that share a prompt prefix, under every state-cache mode, all end with the
  tokens of a cold `generate` — including prompts that end on, or continue past, a radix
  split point (a node without logits: the case that lost requests).
- A fault injected at each named point (`ftjax.engine.faults`: prefill, decode, restore,
  snapshot write, disk read, and the host kernel inside the compiled step) ends the job
  it struck with an error naming it, and the next job on the same scheduler gets the
  right tokens: the donated state and expert cache are rebuilt.
- Deadlines, a full queue, draining, and callbacks that raise.
"""

import time

import numpy as np
import pytest

import ftjax
from ftjax.engine import faults
from ftjax.engine.scheduler import Job, NotAccepting, QueueFull, Scheduler
from ftjax.engine.session import Sampling
from ftjax.engine.state_cache import StateCache

N_NEW = 6


@pytest.fixture(scope="module")
def model():
    return ftjax.load(policy="lru", cache_slots=24, bandwidth=(1.0, 4.0), calibrate=False)  # misses: 1/4 fetched, 3/4 on the host


@pytest.fixture(autouse=True)
def no_faults_left():
    yield
    faults.disarm()


def chat_ids(model, text: str) -> list[int]:
    return model.tokenizer.encode(model.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


class Log:
    """Jobs and what became of them."""

    def __init__(self):
        self.tokens, self.done = {}, {}

    def job(self, prompt, n=N_NEW, sampling=Sampling(), **kw) -> Job:
        key = len(self.tokens)
        self.tokens[key] = []
        return Job(np.asarray(prompt, np.int32), n, sampling, on_token=lambda t: self.tokens[key].append(t) and False,
                   on_done=lambda r: self.done.setdefault(key, []).append(r), id=f"job{key}", **kw)


def run(sch: Scheduler, limit_s: float = 120) -> None:
    t0 = time.monotonic()
    while sch.busy():
        sch.step()
        assert time.monotonic() - t0 < limit_s, "the scheduler did not finish"


@pytest.mark.parametrize("mode", ["off", "prefix", "semantic"])
def test_shared_prefix_requests_all_end_with_cold_tokens(model, mode, tmp_path):
    """8 requests "Tell me of 0" .. "Tell me of 7" at once, then each again alone, and
    prompts that end exactly at the split point and one token beside it."""
    prompts = [chat_ids(model, f"Tell me of {i}") for i in range(8)]
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1])) if a != b)  # the split point
    split_probes = [prompts[3][:shared], prompts[3][:shared + 1], prompts[3][:shared - 1]]
    cold = {tuple(p): model.generate(p, N_NEW) for p in prompts + split_probes}
    cache = None if mode == "off" else StateCache(model, mode, disk_dir=tmp_path / "disk")
    sch, log = Scheduler(model, max_batch=4, prefill_chunk=16, state_cache=cache), Log()
    jobs = [log.job(p) for p in prompts]
    for j in jobs:
        sch.submit(j)
    run(sch)
    again = [log.job(p) for p in [prompts[3], *split_probes, prompts[0]]]
    for j in again:
        sch.submit(j)
        run(sch)
    for j in jobs + again:
        assert log.done[int(j.id[3:])] in (["length"], ["eos"]), (j.id, log.done.get(int(j.id[3:])))
        assert log.tokens[int(j.id[3:])] == cold[tuple(j.prompt.tolist())], j.id
    if cache is not None:
        assert cache.counters["hits"] >= 5  # the repeats reused what the first round cached
    assert sch.stats()["errors"] == 0 and not sch.busy()


FAULTS = ["prefill", "decode", "restore", "snapshot_write", "disk_read", "host_kernel"]


@pytest.mark.parametrize("point", FAULTS)
def test_a_fault_fails_its_job_and_the_next_job_is_right(model, point, tmp_path):
    prompt, other, third = (chat_ids(model, f"Who was {who}?") for who in ("Mr. Darcy", "Emma", "Mr. Bingley"))
    want = {tuple(prompt): model.generate(prompt, N_NEW), tuple(other): model.generate(other, 3 * N_NEW),
            tuple(third): model.generate(third, N_NEW)}
    # a disk tier that every node passes through (host budget 0), so restores read the disk
    cache = StateCache(model, "semantic", device_bytes=0, host_bytes=0, disk_dir=tmp_path / "disk")
    sch, log = Scheduler(model, max_batch=2, prefill_chunk=8, state_cache=cache), Log()
    warm = log.job(prompt)  # puts the prompt in the cache, so the next one restores it
    sch.submit(warm)
    run(sch)
    bystander = log.job(other, n=3 * N_NEW)  # decoding while the fault strikes
    sch.submit(bystander)
    for _ in range(6):
        sch.step()
    if point == "host_kernel":
        from ftjax.host import inject_host_fault
        inject_host_fault(1)
    else:
        faults.arm(point)
    struck = log.job(third)  # restores the shared template prefix, prefills the rest, decodes
    sch.submit(struck)
    run(sch)
    after = log.job(third)
    sch.submit(after)
    run(sch)

    outcome = {j.id: log.done[int(j.id[3:])] for j in (warm, bystander, struck, after)}
    assert all(len(v) == 1 for v in outcome.values()), outcome  # each job ended exactly once
    if point in ("snapshot_write", "disk_read"):
        # the state cache is an optimisation: its failure costs reuse, never the request
        assert outcome["job2"] == ["length"] and log.tokens[2] == want[tuple(third)]
        assert cache.counters["disk_errors"] >= 1
    else:
        assert outcome["job2"][0].startswith("error:"), outcome
        assert "injected" in outcome["job2"][0]
    if point in ("decode", "host_kernel"):  # the batch's step failed: the bystander row went with it
        assert outcome["job1"][0].startswith("error:") or outcome["job1"] == ["length"]
    else:
        assert outcome["job1"] == ["length"] and log.tokens[1] == want[tuple(other)]
    assert outcome["job3"] in (["length"], ["eos"]) and log.tokens[3] == want[tuple(third)]
    assert sch.degraded is None and not sch.busy()


def test_deadline_queue_bound_drain_and_raising_callbacks(model):
    prompt = chat_ids(model, "Call me")
    sch, log = Scheduler(model, max_batch=1, prefill_chunk=8, max_queue=2), Log()
    late = log.job(prompt, n=500, deadline=time.monotonic() + 0.5)
    sch.submit(late)
    queued = log.job(prompt, deadline=time.monotonic() - 1)  # already past: ends without running
    sch.submit(queued)
    with pytest.raises(QueueFull):
        sch.submit(log.job(prompt))
    run(sch)
    assert log.done[0] == ["timeout"] and 0 < len(log.tokens[0]) < 500
    assert log.done[1] == ["timeout"] and log.tokens[1] == []

    def boom(_):
        raise RuntimeError("client callback broke")
    bad = Job(np.asarray(prompt, np.int32), 4, Sampling(), on_token=boom, on_done=lambda r: log.done.update(bad=r))
    good = log.job(prompt)
    sch.submit(bad)
    sch.submit(good)
    run(sch)
    assert log.done["bad"].startswith("error: RuntimeError: client callback broke")
    assert log.done[3] == ["length"] and log.tokens[3] == model.generate(prompt, N_NEW)

    running = log.job(prompt, n=400)
    sch.submit(running)
    sch.step()
    sch.drain()
    with pytest.raises(NotAccepting):
        sch.submit(log.job(prompt))
    sch.fail_pending("error: ServerShutdown: test")
    assert log.done[4] == ["error: ServerShutdown: test"] and not sch.busy()
    assert sch.stats()["timeouts"] == 2


# ---- the Python API decodes on the same loop --------------------------------------------

def test_python_api_decodes_on_the_models_scheduler(model):
    """Session.generate runs as scheduler jobs; two live streams share the loop and each
    gets what it gets alone."""
    a_ids, b_ids = chat_ids(model, "Tell me of 0"), chat_ids(model, "Once upon a time")
    want_a, want_b = model.generate(a_ids, 8), model.generate(b_ids, 8)
    steps = model.api_scheduler().stats()["steps"]
    sa, sb = model.session(), model.session()
    sa.append(a_ids)
    sb.append(b_ids)
    ga, gb = sa.generate_stream(8), sb.generate_stream(8)
    got_a, got_b = [], []
    for ta, tb in zip(ga, gb):  # interleaved: each next() steps both jobs
        got_a.append(ta)
        got_b.append(tb)
    assert got_a == want_a and got_b == want_b
    assert sa.ids == a_ids + want_a and sb.ids == b_ids + want_b
    assert model.api_scheduler().stats()["steps"] > steps
    assert model.api_scheduler().pending() == 0


def session_after(model, ids, *calls):
    """A session holding ids, then continued by generate(n) for each n in calls."""
    s = model.session()
    s.append(ids)
    for n in calls:
        s.generate(n)
    return s


def test_a_closed_stream_hands_its_state_back(model):
    """Stopping a stream early leaves the session where it stopped, able to go on."""
    ids = chat_ids(model, "Tell me of 3")
    ref = session_after(model, ids, 3, 5)
    s = model.session()
    s.append(ids)
    stream = s.generate_stream(20)
    first = [next(stream) for _ in range(3)]
    stream.close()
    assert s.last_generation.stop_reason == "cancelled" and s.ids == ids + first
    s.generate(5)
    assert s.ids == ref.ids


def test_a_failed_decode_in_the_python_api_raises_and_the_session_goes_on(model):
    """The step's error reaches the caller; the session keeps its tokens, re-prefills
    them on its next call and continues as if nothing happened."""
    ids = chat_ids(model, "Tell me of 5")
    ref = session_after(model, ids, 4, 4)
    s = session_after(model, ids, 4)
    faults.arm("decode")
    with pytest.raises(faults.InjectedFault):
        s.generate(4)
    assert s.last_generation.stop_reason.startswith("error: InjectedFault")
    held = s.ids
    assert held[:len(ids) + 4] == ref.ids[:len(ids) + 4]
    s2 = model.session()  # the model serves others
    s2.append(ids)
    assert s2.generate(4) == ref.ids[len(ids):len(ids) + 4]
    # the failed call's first token came from stored logits: it is kept, and the rest follows
    s.generate(len(ref.ids) - len(held))
    assert s.ids == ref.ids
