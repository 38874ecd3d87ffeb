"""Prometheus metrics, named after vLLM's (`vllm:x` is `pagoda:x` here) so dashboards carry over.

Latencies are observed by the engine as tokens reach the request streams; gauges and
totals are read from the executors' schedulers at scrape time. Each Engine has its own
registry: no module-level state.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from scheduler_svc.engine import Engine

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_FINISH_NAMES = {1: "eos", 2: "stop", 3: "stop_token", 4: "length", 5: "abort"}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pagoda:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pagoda:inter_token_latency_seconds", "Time between two tokens of a stream", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pagoda:e2e_request_latency_seconds", "Request latency, arrival to last token", buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pagoda:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pagoda:generation_tokens", "Generated tokens", registry=r)
        self.prefix_queries = Counter("pagoda:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("pagoda:prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.request_success = Counter("pagoda:request_success", "Finished requests by reason", ["finished_reason"], registry=r)
        self.routing = Counter("pagoda:routing_decisions", "Where new requests were sent, and why", ["reason"], registry=r)

    def attach(self, engine: "Engine") -> None:
        self.registry.register(_EngineCollector(engine))

    def serve(self, host: str, port: int):
        return start_http_server(port, addr=host, registry=self.registry)

    def observe_finish(self, arrival: float, prompt_tokens: int, finish_reasons: list[int]) -> None:
        self.e2e.observe(time.monotonic() - arrival)
        self.prompt_tokens.inc(prompt_tokens)
        for reason in finish_reasons:
            self.request_success.labels(_FINISH_NAMES.get(reason, "unknown")).inc()


class _EngineCollector:
    """Gauges and totals read from the live engine when Prometheus scrapes."""

    def __init__(self, engine: "Engine"):
        self._engine = engine

    def collect(self):
        engine = self._engine
        stats = [h.scheduler.stats() for h in engine.executors.values()]
        running = GaugeMetricFamily("pagoda:num_requests_running", "Requests running on executors")
        running.add_metric([], sum(s.num_running for s in stats))
        waiting = GaugeMetricFamily("pagoda:num_requests_waiting", "Requests waiting for a step or an executor")
        waiting.add_metric([], sum(s.num_waiting for s in stats) + len(engine._orphans))
        total = sum(s.num_total_blocks for s in stats)
        free = sum(s.num_free_blocks for s in stats)
        usage = GaugeMetricFamily("pagoda:kv_cache_usage_perc", "Share of KV blocks in use (1 = full)")
        usage.add_metric([], (total - free) / total if total else 0.0)
        executors = GaugeMetricFamily("pagoda:num_executors", "Registered, healthy executors")
        executors.add_metric([], len(stats))
        preemptions = CounterMetricFamily("pagoda:num_preemptions", "Requests preempted (recomputed later)")
        preemptions.add_metric([], engine.num_preemptions_retired + sum(s.num_preemptions for s in stats))
        yield from (running, waiting, usage, executors, preemptions)
