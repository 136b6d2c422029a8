"""A randomized stateful test of the scheduler and the state cache (hypothesis).

Random agent traffic: conversations that grow, are rewritten in the middle, fork (two
requests with one history at once), diverge exactly at and one token beside the points
the cache split or stored, and are cancelled mid-way — run through one `Scheduler` with
a `StateCache` whose device, host and disk budgets are small enough that nodes move
between tiers and fall off the end all the time. After every step:

- every job is queued, running or ended exactly once (nothing lost, nothing twice); a
  job submitted to a full queue (max_queue) is refused at once and never heard of again;
- every job that ended normally produced the tokens of a cold `Model.generate` of its
  prompt (a cancelled one: a prefix of them) — reuse never changes an output. The model
  runs numerics="exact": under "fast" the bf16 roundings (activations on the tiles, the
  K/V cache) turn the f32 summation-order differences between a chunked prefill and a
  cold one into small logit differences (the default model, 60 tokens in chunks of 16
  against one call: 4e-3; exact: 2e-6), which can flip a near-tie (test_numerics holds
  fast to exact's perplexity and greedy tokens);
- the cache's counters add up (lookups = hits + misses; reused + prefilled tokens =
  the prompts looked up) and each tier is within its budget (over it only while
  every node left there has a child that needs it).

The default profile runs in CI in bounded time; `pytest -m slow` runs a longer one.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

import ftjax
from ftjax.engine.scheduler import Job, QueueFull, Scheduler
from ftjax.engine.session import Sampling
from ftjax.engine.state_cache import TIERS, StateCache

N_NEW = 3
MAX_PROMPT = 160
TOKENS = st.lists(st.integers(0, 4000), min_size=1, max_size=24)
_MODEL = {}


def model():
    if "m" not in _MODEL:
        _MODEL["m"] = ftjax.load(policy="lru", cache_slots=24, bandwidth=(1.0, 4.0), calibrate=False,
                                 numerics="exact")
    return _MODEL["m"]


class EngineMachine(RuleBasedStateMachine):
    conversations = Bundle("conversations")

    def __init__(self):
        super().__init__()
        import tempfile

        self.model = model()
        self.disk = tempfile.TemporaryDirectory(prefix="ftjax-stateful-")
        kib = 1024
        self.cache = StateCache(self.model, "semantic", device_bytes=512 * kib, host_bytes=512 * kib,
                                disk_dir=self.disk.name, disk_bytes=3072 * kib)
        self.sch = Scheduler(self.model, max_batch=2, prefill_chunk=16, state_cache=self.cache, max_queue=64)
        self.jobs: list[tuple[Job, list[int], list[str]]] = []  # job, its tokens, its outcomes
        self.rejected: list[tuple[Job, list[str]]] = []  # refused by a full queue: job, its outcomes
        self.looked_up = 0  # prompt tokens of every job admitted (the cache looked each one up)

    def teardown(self):
        while self.sch.busy():
            self.sch.step()
        self.check_jobs(final=True)
        self.disk.cleanup()

    # ---- traffic ----------------------------------------------------------------------------
    # each new history is sent at once, as an agent does; `submit` and `fork` send again
    @initialize(target=conversations, ids=TOKENS)
    def first(self, ids):
        return self._send(ids)

    @rule(target=conversations, conv=conversations, extra=TOKENS)
    def append(self, conv, extra):
        return self._send((conv + extra)[-MAX_PROMPT:])

    @rule(target=conversations, conv=conversations, at=st.floats(0, 1), new=TOKENS)
    def rewrite_middle(self, conv, at, new):
        i = int(at * len(conv))
        return self._send((conv[:i] + new + conv[i + len(new):])[:MAX_PROMPT])

    @rule(target=conversations, offset=st.sampled_from([-1, 0, 1]), which=st.floats(0, 1), extra=TOKENS,
          splits_only=st.booleans())
    def diverge_at_a_stored_point(self, offset, which, extra, splits_only):
        """Cut at a node's end (a split point, or any stored node), or one token beside it,
        and continue with new tokens."""
        nodes = sorted((n for n in self.cache._nodes() if n.kind == "split" or not splits_only),
                       key=lambda n: n.depth)
        if not nodes:
            return self._send(extra)
        node = nodes[int(which * (len(nodes) - 1))]
        k = max(1, node.depth + offset)
        ids = node.ids() if offset <= 0 else (node.ids() + [c.edge[0] for c in node.children[:1]] or [0])
        return self._send((ids[:k] + extra)[:MAX_PROMPT])

    def _send(self, ids):
        self._submit(ids, None)
        return ids

    @rule(conv=conversations, cancel_after=st.one_of(st.none(), st.integers(0, 6)))
    def submit(self, conv, cancel_after):
        self._submit(conv, cancel_after)

    @rule(conv=conversations)
    def fork(self, conv):
        """Two requests with one history at once."""
        self._submit(conv, None)
        self._submit(conv, None)

    @rule(steps=st.integers(1, 8))
    def advance(self, steps):
        for _ in range(steps):
            if self.sch.busy():
                self.sch.step()
        for job, _, _ in self.jobs:
            if getattr(job, "cancel_at", None) is not None and job.outcome is None and \
                    self.sch._counts["steps"] >= job.cancel_at:
                self.sch.cancel(job)

    def _submit(self, ids, cancel_after):
        tokens, outcomes = [], []
        job = Job(np.asarray(ids, np.int32), N_NEW, Sampling(), on_token=lambda t: tokens.append(t) and False,
                  on_done=outcomes.append, id=f"job{len(self.jobs)}")
        job.cancel_at = None if cancel_after is None else self.sch._counts["steps"] + cancel_after
        try:
            self.sch.submit(job)
        except QueueFull:  # a burst past max_queue: refused at once, never queued, never told
            assert self.sch._queued() == self.sch.max_queue
            self.rejected.append((job, outcomes))
            return
        self.jobs.append((job, tokens, outcomes))

    # ---- invariants -------------------------------------------------------------------------------
    def check_jobs(self, final: bool = False):
        ended = 0
        for job, tokens, outcomes in self.jobs:
            assert len(outcomes) <= 1, (job.id, outcomes)
            if not outcomes:
                assert not final, f"{job.id} never ended"
                continue
            ended += 1
            reason = outcomes[0]
            assert reason in ("length", "eos", "cancelled"), (job.id, reason)
            want = cold(self.model, job.prompt)
            if reason == "cancelled":
                assert tokens == want[:len(tokens)], job.id
            else:
                assert tokens == want, (job.id, tokens, want)
        assert ended + self.sch.pending() == len(self.jobs)
        assert all(not outcomes for _, outcomes in self.rejected)
        assert self.sch._counts["rejected"] == len(self.rejected)

    @invariant()
    def jobs_end_once_with_cold_tokens(self):
        self.check_jobs()

    @invariant()
    def cache_counters_and_budgets(self):
        c = self.cache.counters
        assert c["lookups"] == c["hits"] + c["misses"]
        admitted = [j for j, _, _ in self.jobs if j.outcome is not None or j is _prefilling(self.sch)
                    or any(r is not None and r.job is j for r in self.sch._rows)]
        assert c["tokens_reused"] + c["tokens_prefilled"] <= sum(j.prompt.size for j, _, _ in self.jobs)
        assert c["lookups"] <= len(admitted)  # a job cancelled in the queue is never looked up
        for tier in TIERS:
            nodes = [n for n in self.cache._nodes() if n.tier == tier]
            total = sum(n.nbytes for n in nodes)
            assert total <= self.cache.budget[tier] or all(n.children for n in nodes) or len(nodes) == 1, \
                (tier, total, self.cache.budget[tier])


def _prefilling(sch):
    return sch._prefill.job if sch._prefill is not None else None


_COLD: dict[tuple, list[int]] = {}


def cold(model, prompt) -> list[int]:
    key = tuple(int(t) for t in prompt)
    if key not in _COLD:
        _COLD[key] = model.generate(list(key), N_NEW)
    return _COLD[key]


TestEngineStateful = EngineMachine.TestCase
TestEngineStateful.settings = settings(max_examples=6, stateful_step_count=14, deadline=None, derandomize=True,
                                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class LongEngineMachine(EngineMachine):
    pass


TestEngineStatefulLong = pytest.mark.slow(LongEngineMachine.TestCase)
TestEngineStatefulLong.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
