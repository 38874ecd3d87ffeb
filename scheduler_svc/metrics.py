"""Prometheus metrics, named after vLLM's (`vllm:x` is `pagoda:x` here) so dashboards carry over.

Latencies are observed as tokens reach the request streams; gauges and totals are read
from a snapshot of the engine (`Engine.snapshot()`) at scrape time. Each Engine has its
own registry: no module-level state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from scheduler_svc.core import FinishReason, SchedulerStats, SpecDecodeStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


@dataclass(frozen=True)
class ExecutorSnapshot:
    executor_id: str
    device: str
    healthy: bool
    stats: SchedulerStats
    weight_bytes: int = 0  # the model's resident weights, as the executor registered them


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's live figures: each executor's scheduler, plus requests bound to none yet."""

    executors: list[ExecutorSnapshot]
    num_queued: int  # in the engine's waiting queue
    num_preemptions_retired: int  # counted by executors that are gone

    @property
    def num_running(self) -> int:
        return sum(e.stats.num_running for e in self.executors)

    @property
    def num_waiting(self) -> int:
        return self.num_queued + sum(e.stats.num_waiting for e in self.executors)

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_retired + sum(e.stats.num_preemptions for e in self.executors)


class Metrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
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
        self.request_errors = Counter(
            "pagoda:request_errors",
            "Requests ended with INTERNAL: executor_error (pinned on it by its executor), poison_pill (in the step of 2 lost executors)",
            ["reason"], registry=r,
        )
        self.spec_drafts = Counter("pagoda:spec_decode_num_drafts", "Speculative drafts verified", registry=r)
        self.spec_draft_tokens = Counter("pagoda:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.spec_accepted_tokens = Counter("pagoda:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.spec_accepted_per_pos = Counter(
            "pagoda:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft", ["position"], registry=r
        )

        self.registry.register(_SnapshotCollector(snapshot))

    def serve(self, host: str, port: int):
        """Serve /metrics; called on the event loop, whose task count it then reports (leak checks)."""
        server = start_http_server(port, addr=host, registry=self.registry)
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, process_open_fds, ...
        self.registry.register(_LoopCollector(asyncio.get_running_loop()))
        return server

    def observe_first_token(self, arrival: float, prompt_tokens: int, cached_tokens: int) -> None:
        self.ttft.observe(time.monotonic() - arrival)
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)

    def observe_spec_decode(self, stats: SpecDecodeStats) -> None:
        if not stats.num_drafts:
            return
        self.spec_drafts.inc(stats.num_drafts)
        self.spec_draft_tokens.inc(stats.num_draft_tokens)
        self.spec_accepted_tokens.inc(stats.num_accepted_tokens)
        for position, count in enumerate(stats.num_accepted_tokens_per_pos):
            self.spec_accepted_per_pos.labels(str(position)).inc(count)

    def observe_finish(self, arrival: float, prompt_tokens: int, finish_reasons: list[int]) -> None:
        self.e2e.observe(time.monotonic() - arrival)
        self.prompt_tokens.inc(prompt_tokens)
        for reason in finish_reasons:
            self.request_success.labels(FinishReason(reason).name.lower()).inc()


class _LoopCollector:
    """The event loop's live asyncio tasks: a count that grows without bound is a leak (bench/soak.py)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop

    def collect(self):
        tasks = GaugeMetricFamily("pagoda:asyncio_tasks", "Live asyncio tasks on the scheduler's event loop")
        for _ in range(3):  # read from the metrics thread: the loop may change the set meanwhile
            try:
                tasks.add_metric([], len(asyncio.all_tasks(self._loop)))
                break
            except RuntimeError:
                continue
        yield tasks


class _SnapshotCollector:
    """Gauges and totals read from an engine snapshot when Prometheus scrapes."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]):
        self._snapshot = snapshot

    def describe(self):
        return []  # the registry then needs no snapshot at registration (the engine is not built yet)

    def collect(self):
        snap = self._snapshot()
        stats = [e.stats for e in snap.executors]
        running = GaugeMetricFamily("pagoda:num_requests_running", "Requests running on executors")
        running.add_metric([], snap.num_running)
        waiting = GaugeMetricFamily("pagoda:num_requests_waiting", "Requests waiting for a step or an executor")
        waiting.add_metric([], snap.num_waiting)
        total = sum(s.num_total_blocks for s in stats)
        free = sum(s.num_free_blocks for s in stats)
        usage = GaugeMetricFamily("pagoda:kv_cache_usage_perc", "Share of KV blocks in use (1 = full)")
        usage.add_metric([], (total - free) / total if total else 0.0)
        executors = GaugeMetricFamily("pagoda:num_executors", "Registered, healthy executors")
        executors.add_metric([], len(stats))
        preemptions = CounterMetricFamily("pagoda:num_preemptions", "Requests preempted (recomputed later)")
        preemptions.add_metric([], snap.num_preemptions)
        yield from (running, waiting, usage, executors, preemptions)
