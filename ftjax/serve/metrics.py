"""`GET /metrics`: the server's state in the Prometheus text format (prometheus-client).

Two kinds of series:
- observed as requests end (the scheduler tells its `listeners` of every job's end, on
  the engine thread): requests by outcome, time to first token and time per output
  token histograms, refusals at the door by status and kind;
- read at scrape time from the engine (a collector over `Engine.stats()`, which takes
  the step lock, so the numbers are those between two steps): queue depth, running and
  prefilling rows, tokens reused vs prefilled and state-cache lookups by what they hit,
  device bytes in use, expert-cache selections / hits, and each device's share of them.

Each server has its own registry (no process globals), so tests can run several.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from ftjax.engine.scheduler import Job
    from ftjax.serve.core import Engine, Generation, ServeError

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("ftjax_requests", "Requests that ended, by outcome", ["outcome"], registry=r)
        self.refusals = Counter("ftjax_refused_requests", "Requests refused before they were queued",
                                ["status", "kind"], registry=r)
        self.ttft = Histogram("ftjax_time_to_first_token_seconds", "Request received to first token (queue included)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("ftjax_time_per_output_token_seconds", "Decode time per token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.tokens = Counter("ftjax_generated_tokens", "Tokens generated", registry=r)
        self._gens: dict[int, Generation] = {}  # id(job) -> its generation, while it runs
        r.register(_EngineCollector(engine))
        engine.scheduler.listeners.append(self._ended)

    def started(self, gen: Generation) -> None:
        self._gens[id(gen.job)] = gen

    def refused(self, e: ServeError) -> None:
        self.refusals.labels(str(e.status), e.kind).inc()

    def _ended(self, job: Job, reason: str) -> None:
        self.requests.labels(reason.split(":")[0]).inc()
        self.tokens.inc(job.new_tokens)
        gen = self._gens.pop(id(job), None)
        if gen is None or gen.t_first is None:
            return
        self.ttft.observe(gen.t_first - gen.t_start)
        if job.new_tokens > 1:
            self.tpot.observe((time.perf_counter() - gen.t_first) / (job.new_tokens - 1))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    """Gauges and counters read off `Engine.stats()` at scrape time."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def describe(self):
        return []  # read at scrape time: nothing to describe up front

    def collect(self):
        st = self.engine.stats()
        sessions, experts, cache = st["sessions"], st["experts"], st["state_cache"]
        yield _gauge("ftjax_queue_depth", "Requests waiting to be admitted", sessions["queued"])
        yield _gauge("ftjax_running_rows", "Requests decoding in the batch", sessions["active"])
        yield _gauge("ftjax_prefilling", "Requests being prefilled", sessions["prefilling"])
        yield _gauge("ftjax_up", "1 while the engine serves, 0 while draining or degraded",
                     int(sessions["accepting"] and not sessions["degraded"]))
        yield _counter("ftjax_engine_recoveries", "Failed steps after which the expert cache was rebuilt",
                       sessions["recoveries"])
        reused = CounterMetricFamily("ftjax_prompt_tokens", "Prompt tokens, by how they were obtained",
                                     labels=["source"])
        reused.add_metric(["state_cache"], cache.get("tokens_reused", 0))
        reused.add_metric(["prefill"], cache.get("tokens_prefilled", experts["prefill_tokens"]))
        yield reused
        lookups = CounterMetricFamily("ftjax_state_cache_lookups", "State-cache lookups, by the node they ended on",
                                      labels=["hit"])
        for kind, n in cache.get("hit_kinds", {}).items():
            lookups.add_metric([kind], n)
        lookups.add_metric(["miss"], cache.get("misses", 0))
        yield lookups
        yield _counter("ftjax_expert_selections", "Routed expert selections", experts["selections"])
        yield _counter("ftjax_expert_cache_hits", "Selections found in the device expert cache", experts["hits"])
        yield _gauge("ftjax_expert_cache_hit_rate", "hits / selections since load",
                     experts["hits"] / experts["selections"] if experts["selections"] else 0.0)
        idle = st.get("idle_reprefill")
        if idle is not None:
            family = CounterMetricFamily("ftjax_idle_reprefill", "Idle re-prefill: predictions made, checked right "
                                         "or wrong (tokens), tokens prefilled while idle and ready when asked",
                                         labels=["what"])
            for what in ("predictions", "token_exact", "token_wrong", "tokens_ready"):
                family.add_metric([what], idle[what])
            family.add_metric(["tokens_prefilled"], sessions["idle"]["tokens"])
            family.add_metric(["preempted"], sessions["idle"]["preempted"])
            yield family
        per_device = experts.get("devices", [])
        for name, key, doc in (("ftjax_device_expert_hits", "hits", "Selections found in a device's expert cache"),
                               ("ftjax_device_expert_fetched", "fetched", "Misses a device fetched into its cache"),
                               ("ftjax_device_expert_host", "host_computed", "A device's misses computed on the host"),
                               ("ftjax_device_bytes_fetched", "bytes_fetched", "Expert bytes a device fetched")):
            family = CounterMetricFamily(name, doc + " (by device)", labels=["device"])
            for d in per_device:
                family.add_metric([d["device"]], d[key])
            yield family
        device = st["memory"].get("device_bytes_in_use")
        if device is not None:
            yield _gauge("ftjax_device_bytes_in_use", "Device memory in use (the backend's count)", device)
        yield _gauge("ftjax_resident_bytes", "Resident memory of the process", st["memory"].get("rss_bytes", 0))


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
