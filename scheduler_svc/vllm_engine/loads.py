"""The scheduler's load as the protocol reports it: `GetLoads`' `SchedulerLoad` and the load
record (`EngineLoad`) the KV-event stream carries, from one reading of the engine.

The scheduler is one data-parallel rank (rank 0) to the router, whatever its executors:

    num_running_reqs / num_waiting_reqs   requests on executors / waiting (engine queue + executors)
    max_total_num_tokens                  every executor's KV blocks x block_size
    num_used_tokens, token_usage          blocks in use (cached-but-free ones not counted) x block_size,
                                          and their share: vLLM's kv_cache_usage
    max_running_requests                  --max-num-seqs x executors
    gen_throughput, cache_hit_rate        generated tokens per second and prompt tokens found cached,
                                          over the last `WINDOW_S` seconds (the engine's counters)

Every figure is O(executors) to read: the stream asks for it every step and every 100 ms.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import Counter
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import common_pb2

from scheduler_svc.engine import Engine

# The window of the rates: long enough to smooth a step's burst, short enough to follow the load.
WINDOW_S = 5.0


def _total(counter: Counter) -> float:
    """A prometheus Counter's value, through its public collect()."""
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                return sample.value
    return 0.0


@dataclass(frozen=True)
class Load:
    num_running: int
    num_waiting: int
    num_used_tokens: int
    max_total_num_tokens: int
    max_running_requests: int
    gen_throughput: float
    cache_hit_rate: float

    @property
    def token_usage(self) -> float:
        return self.num_used_tokens / self.max_total_num_tokens if self.max_total_num_tokens else 0.0


class LoadReader:
    """Reads the engine's load; keeps the counters' recent samples for the rates."""

    def __init__(self, engine: Engine, clock=time.monotonic):
        self.engine = engine
        self._clock = clock
        self._samples: deque[tuple[float, float, float, float]] = deque()  # (t, generated, queried, hit)

    def read(self) -> Load:
        engine, block_size = self.engine, self.engine.config.block_size
        handles = engine.pool.alive
        pools = [h.scheduler.kv_cache_manager.block_pool for h in handles]
        total = sum(p.num_total_blocks for p in pools)
        used = total - sum(p.num_free_blocks for p in pools)
        throughput, hit_rate = self._rates()
        return Load(
            num_running=sum(h.scheduler.num_running for h in handles),
            num_waiting=engine.queue.num_requests + sum(h.scheduler.num_waiting for h in handles),
            num_used_tokens=used * block_size,
            max_total_num_tokens=total * block_size,
            max_running_requests=engine.config.max_num_seqs * len(handles),
            gen_throughput=throughput,
            cache_hit_rate=hit_rate,
        )

    def _rates(self) -> tuple[float, float]:
        metrics, now = self.engine.metrics, self._clock()
        sample = (now, _total(metrics.generation_tokens), _total(metrics.prefix_queries), _total(metrics.prefix_hits))
        samples = self._samples
        samples.append(sample)
        while len(samples) > 2 and now - samples[1][0] >= WINDOW_S:
            samples.popleft()
        first = samples[0]
        elapsed = now - first[0]
        throughput = (sample[1] - first[1]) / elapsed if elapsed > 0 else 0.0
        queried = sample[2] - first[2]
        return throughput, (sample[3] - first[3]) / queried if queried else 0.0

    def scheduler_load(self) -> vpb.SchedulerLoad:
        load = self.read()
        return vpb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=load.num_running,
            num_waiting_reqs=load.num_waiting,
            num_total_reqs=load.num_running + load.num_waiting,
            num_used_tokens=load.num_used_tokens,
            max_total_num_tokens=load.max_total_num_tokens,
            token_usage=load.token_usage,
            gen_throughput=load.gen_throughput,
            cache_hit_rate=load.cache_hit_rate,
            max_running_requests=load.max_running_requests,
        )

    def engine_load(self, dp_rank: int | None = None) -> common_pb2.EngineLoad:
        """The load record (`smg_grpc_servicer.load_record.LoadSource`): this scheduler is rank 0."""
        load = self.read()
        return common_pb2.EngineLoad(
            running_requests=load.num_running,
            waiting_requests=load.num_waiting,
            token_usage=load.token_usage,
            active_token_usage=load.token_usage,
            gen_throughput=load.gen_throughput,
            max_running_requests=load.max_running_requests,
            cache_hit_rate=load.cache_hit_rate,
            num_used_tokens=load.num_used_tokens,
            max_total_num_tokens=load.max_total_num_tokens,
        )
