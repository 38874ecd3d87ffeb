"""The executors: registration, heartbeats, the monitor, retirement and routing.

The pool is the ZeroMQ link's listener: every callback gets the executor id of the
authenticated connection the message came on (scheduler_svc/link.py drops messages that
name another executor), never trusting an id inside a message. Each registered executor is an `ExecutorHandle`
with its own core `Scheduler` (its running requests and KV blocks). The pool knows
nothing of client requests: it tells the engine when an executor joins
(`on_joined(handle)`) and when one is gone, with its unfinished requests drained, tokens
so far kept (`on_lost(handle, requests)`). `choose()` is the routing rule of late
binding: among the executors that can admit a request now, the one caching most of
its prompt (within a load slack), then the least loaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagoda import wire
from pagoda.link_security import LinkKeys
from pagoda.step import StepPlan, StepResult
from pagoda.v1 import executor_pb2 as xpb
from scheduler_svc.core import (
    PoolingRequest, PoolingScheduler, PoolingSchedulerConfig, Request, Scheduler, SchedulerConfig, SpeculativeConfig,
)
from scheduler_svc.link import ExecutorLink
from scheduler_svc.metrics import Metrics
from scheduler_svc.result_check import max_executor_message_bytes, result_shape_problem, sampled_values_problem

log = logging.getLogger(__name__)

# The most KV cache groups and layers a Register may name: every step does O(groups) work per
# request (Gemma 3 27B: 7 groups of 10 of its 62 layers).
MAX_KV_CACHE_GROUPS = 256
MAX_KV_CACHE_LAYERS = 4096

# Step token budgets when --max-num-batched-tokens is not given, by the executor's device. A GPU's
# matmuls want big steps. A CPU reaches its matmul peak by a few hundred rows, while every prompt
# token in a step delays that step's decodes: on 2 cores (bench/loadgen.py, the aim's workload)
# 512 gave the same throughput as 2048 (158.6 vs 159.7 tokens/s) and an ITL p99 of 0.76 s vs 2.74 s.
DEFAULT_GPU_STEP_BUDGET = 2048
DEFAULT_CPU_STEP_BUDGET = 512


@dataclass(frozen=True)
class EngineConfig:
    model_fingerprint: str
    block_size: int = 16
    max_num_batched_tokens: int | None = None  # None: by device (step_budget)
    max_num_seqs: int = 256
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 1024
    max_requests_per_tenant: int = 0  # running + waiting requests of one API-key tenant; 0 = no limit
    max_running_per_tenant: int = 0  # running slots of one tenant while another waits; 0 = max_num_seqs // tenants with work
    executor_timeout_s: float = 2.0
    no_executor_wait_s: float = 30.0
    async_scheduling: bool = True  # plan step N+1 while step N runs
    # security (#13): what an executor may claim and return
    vocab_size: int | None = None  # None: token ids are not range-checked
    max_kv_blocks: int = 2**24  # largest num_kv_blocks a Register may announce
    step_timeout_s: float = 120.0  # a step result later than this: the executor is hung (#16)
    speculative: SpeculativeConfig | None = None  # draft tokens (async scheduling is then off)
    # LoRA adapters (scheduler_svc/lora_registry.py): on, how many a step, their largest rank
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 64
    # "generate", or "pooling" (--runner): every executor must run the same (Register.runner);
    # a pooling executor's core is a PoolingScheduler (whole inputs, no KV blocks)
    runner: str = "generate"

    def __post_init__(self):
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "max_waiting_requests"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_running_per_tenant < 0:
            raise ValueError(f"max_running_per_tenant must not be negative, got {self.max_running_per_tenant}")
        if self.max_requests_per_tenant < 0:
            raise ValueError(f"max_requests_per_tenant must not be negative, got {self.max_requests_per_tenant}")
        if self.executor_timeout_s <= 0 or self.no_executor_wait_s < 0 or self.step_timeout_s <= 0:
            raise ValueError("executor_timeout_s and step_timeout_s must be positive and no_executor_wait_s not negative")
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"runner must be 'generate' or 'pooling', got {self.runner!r}")

    def step_budget(self, device: str) -> int:
        """Tokens one step of an executor on `device` ("cpu", "cuda:0", ...) may compute."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_CPU_STEP_BUDGET if device.split(":")[0] == "cpu" else DEFAULT_GPU_STEP_BUDGET


@dataclass(eq=False)
class ExecutorHandle:
    executor_id: str
    device: str
    scheduler: Scheduler | PoolingScheduler
    last_seen: float
    alive: bool = True
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    pending: dict[int, asyncio.Future] = field(default_factory=dict)  # step id -> its result
    scheduled: dict[int, frozenset[str]] = field(default_factory=dict)  # step id in flight -> its core req ids
    suspects: frozenset[str] = frozenset()  # once lost by a failure: the core req ids of its steps in flight
    task: asyncio.Task | None = None
    weight_bytes: int = 0  # the model's resident weights, as the executor registered them

    def load(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting


def _prefix_routing_slack(least_load: int) -> int:
    """How many more requests than the least loaded executor one may hold and still win on a prefix hit."""
    return max(1, least_load // 4)


class ExecutorPool:
    def __init__(
        self,
        config: EngineConfig,
        bind: str,
        metrics: Metrics,
        on_joined: Callable[[ExecutorHandle], None],
        on_lost: Callable[[ExecutorHandle, list[Request]], None],
        link_keys: LinkKeys | None = None,
    ) -> None:
        self.config = config
        self.link = ExecutorLink(
            bind, self, keys=link_keys, registry=metrics.registry,
            max_message_bytes=max_executor_message_bytes(config.max_num_batched_tokens or DEFAULT_GPU_STEP_BUDGET),
        )
        self.metrics = metrics
        self.executors: dict[str, ExecutorHandle] = {}
        self.num_preemptions_retired = 0  # preemptions counted by executors that are gone
        self._on_joined, self._on_lost = on_joined, on_lost
        self._shut_down: set[str] = set()  # judged hung and told to shut down: their heartbeats get no config
        self.loras = None  # scheduler_svc.lora_registry.LoraRegistry with --enable-lora
        # a request's tokens in one step: its own, plus the drafts it verifies
        self._max_tokens_per_request = 1 + (config.speculative.num_speculative_tokens if config.speculative else 0)

    @property
    def alive(self) -> list[ExecutorHandle]:
        return [h for h in self.executors.values() if h.alive]

    # ---- routing --------------------------------------------------------------------------
    def can_ever_fit(self, num_tokens: int) -> bool:
        return any(h.scheduler.can_fit(num_tokens) for h in self.alive)

    def max_seq_len(self) -> int | None:
        """The longest sequence the largest executor holds (None: no executor)."""
        return max((h.scheduler.max_seq_len for h in self.alive), default=None)

    def choose(self, requests: Sequence[Request]) -> ExecutorHandle | None:
        """The executor to bind `requests` (one group) to now, or None if none can admit them now.

        A prefix hit counts only on executors about as loaded as the least loaded one
        (`_prefix_routing_slack`): a prefix every prompt shares, like a chat template's
        system prompt, would otherwise send all work to the first executor that cached it.
        """
        first = requests[0]
        fits = [h for h in self.alive if h.scheduler.can_fit(first.num_tokens + 1)]
        if not fits:
            return None
        loads = {h.executor_id: h.load() for h in fits}
        least = min(loads.values())
        hits = {
            h.executor_id: h.scheduler.num_prefix_cached_tokens(first)
            for h in fits
            if loads[h.executor_id] <= least + _prefix_routing_slack(least)
        }
        ready = [h for h in fits if h.scheduler.can_admit(requests, hits.get(h.executor_id, 0))]
        if not ready:
            return None
        best_hit = max((hits.get(h.executor_id, 0) for h in ready), default=0)
        if best_hit > 0:
            self.metrics.routing.labels("prefix_hit").inc()
            ready = [h for h in ready if hits.get(h.executor_id, 0) == best_hit]
        else:
            self.metrics.routing.labels("least_loaded").inc()
        return min(ready, key=lambda h: loads[h.executor_id])

    # ---- steps ----------------------------------------------------------------------------
    async def execute(self, handle: ExecutorHandle, plan: StepPlan) -> asyncio.Future:
        """Send `plan`; the future of its `StepResult` (cancelled if the executor goes)."""
        future = asyncio.get_running_loop().create_future()
        handle.pending[plan.step_id] = future
        handle.scheduled[plan.step_id] = frozenset(plan.num_scheduled_tokens).union(r.req_id for r in plan.pool_requests)
        log.debug("executor %s step %d: %s", handle.executor_id, plan.step_id, plan.num_scheduled_tokens)
        if not await self.link.send_plan(handle.executor_id, plan):
            self.kill(handle, "unreachable")
        return future

    def on_step_result(self, executor_id: str, msg: xpb.StepResult) -> None:
        handle = self.executors.get(executor_id)
        future = handle.pending.pop(msg.step_id, None) if handle is not None else None
        if future is None or future.done():
            return
        handle.last_seen = time.monotonic()
        if msg.error:
            log.error("executor %s failed step %d: %s", executor_id, msg.step_id, msg.error)
            self.kill(handle, f"step failed: {msg.error}")  # this step's requests are among the suspects
            return
        scheduled = handle.scheduled.pop(msg.step_id, frozenset())
        problem = result_shape_problem(msg, scheduled, self._max_tokens_per_request, handle.scheduler.requested_top_logprobs)
        if problem:
            self.reject(handle, problem)
            return
        result: StepResult = wire.result_from_proto(msg)
        problem = sampled_values_problem(result, self.config.vocab_size) if self.config.vocab_size else ""
        if problem:
            self.reject(handle, problem)
            return
        future.set_result(result)

    def reject(self, handle: ExecutorHandle, problem: str) -> None:
        """security (#13): `handle` broke the step protocol: end its session for good, move its requests.

        Its requests resume elsewhere from the tokens accepted before the bad result; the
        link ignores it from now on, and it is told to shut down.
        """
        log.error("executor %s sent an invalid step result, dropping it: %s", handle.executor_id, problem)
        self.link.ban(handle.executor_id)
        self.kill(handle, f"invalid step result: {problem}")
        asyncio.ensure_future(
            self.link.send(handle.executor_id, xpb.SchedulerMessage(shutdown=xpb.Shutdown(reason=problem)))
        )

    # ---- life cycle -----------------------------------------------------------------------
    async def stop(self) -> None:
        """Not Shutdown: executors keep their weights and cache and register with the next scheduler."""
        notice = xpb.SchedulerMessage(stopping=xpb.SchedulerStopping(reason="scheduler stopping"))
        for handle in list(self.executors.values()):
            await self.link.send(handle.executor_id, notice)
            self._retire(handle)
        # linger: a socket closed at once drops the notices still queued, and an executor
        # would only see the connection drop
        self.link.close(linger_s=1.0)

    def judge_hung(self, handle: ExecutorHandle, step_id: int) -> None:
        """No result for `step_id` within the step timeout: tell the executor to shut down, move its requests."""
        why = f"step timeout: no result for step {step_id} in {self.config.step_timeout_s:g} s"
        self._shut_down.add(handle.executor_id)
        asyncio.ensure_future(self.link.send(handle.executor_id, xpb.SchedulerMessage(shutdown=xpb.Shutdown(reason=why))))
        self.kill(handle, why)

    def on_hello(self, executor_id: str, msg: xpb.Hello) -> None:
        asyncio.ensure_future(self.link.send(executor_id, self._config_message()))

    def _config_message(self) -> xpb.SchedulerMessage:
        return xpb.SchedulerMessage(
            config=xpb.ExecutorConfig(
                block_size=self.config.block_size,
                # the largest step this scheduler may plan (a GPU executor profiles its memory with it)
                max_num_batched_tokens=self.config.max_num_batched_tokens or DEFAULT_GPU_STEP_BUDGET,
                model_fingerprint=self.config.model_fingerprint,
                enable_lora=self.config.enable_lora,
                max_lora_rank=self.config.max_lora_rank,
            )
        )

    def on_register(self, executor_id: str, msg: xpb.Register) -> None:
        problem = self._registration_problem(msg)
        if problem:
            log.error("refusing executor %s: %s", executor_id, problem)
            asyncio.ensure_future(
                self.link.send(executor_id, xpb.SchedulerMessage(shutdown=xpb.Shutdown(reason=problem)))
            )
            return
        old = self.executors.get(executor_id)
        if old is not None:
            self.kill(old, "re-registered", blame=False)
        budget = self.config.step_budget(msg.device)
        groups = wire.kv_cache_groups_from_proto(msg.kv_cache_groups)
        if self.config.runner == "pooling":
            core = PoolingScheduler(PoolingSchedulerConfig(budget, self.config.max_num_seqs, self.config.max_model_len))
            budget = core.config.step_budget
        else:
            core = self._generation_scheduler(msg, budget, groups)
        handle = ExecutorHandle(executor_id, msg.device, core, last_seen=time.monotonic(), weight_bytes=msg.weight_bytes)
        self.executors[executor_id] = handle
        log.info(
            "executor %s registered: %s, %s runner, %d KV blocks, steps of up to %d tokens, KV cache groups %s",
            executor_id, msg.device, self.config.runner, msg.num_kv_blocks, budget,
            [("full" if g.sliding_window is None else g.sliding_window, len(g.layer_ids)) for g in groups],
        )
        self._on_joined(handle)

    def _generation_scheduler(self, msg: xpb.Register, budget: int, groups) -> Scheduler:
        return Scheduler(
            SchedulerConfig(
                block_size=msg.block_size,
                num_blocks=msg.num_kv_blocks,
                max_num_batched_tokens=budget,
                max_num_seqs=self.config.max_num_seqs,
                max_model_len=self.config.max_model_len,
                enable_prefix_caching=self.config.enable_prefix_caching,
                speculative=self.config.speculative,
                enable_kv_cache_events=self.config.enable_prefix_caching,  # drained every step (Engine._update)
                kv_cache_groups=groups,
                max_loras=self.config.max_loras if self.config.enable_lora else 0,
                max_running_per_tenant=self.config.max_running_per_tenant,
                whole_image_chunks=msg.whole_image_chunks,
            )
        )

    async def send_registered(self, handle: ExecutorHandle) -> None:
        """Registered goes out before the first plan: until it has it, an executor drops plans."""
        await self.link.send(handle.executor_id, xpb.SchedulerMessage(registered=xpb.Registered()))

    def _registration_problem(self, msg: xpb.Register) -> str:
        if msg.model_fingerprint != self.config.model_fingerprint:
            return f"model fingerprint {msg.model_fingerprint} differs from the scheduler's {self.config.model_fingerprint}"
        runner = msg.runner or "generate"  # (executors from before --runner generate)
        if runner != self.config.runner:
            return f"runner {runner!r} differs from the scheduler's {self.config.runner!r} (--runner)"
        if runner == "pooling":
            return ""  # no KV cache: its blocks and groups mean nothing here
        if msg.block_size != self.config.block_size:
            return f"block size {msg.block_size} differs from the scheduler's {self.config.block_size}"
        if msg.num_kv_blocks < 2:
            return f"num_kv_blocks {msg.num_kv_blocks} is too small"
        if msg.num_kv_blocks > self.config.max_kv_blocks:
            return f"num_kv_blocks {msg.num_kv_blocks} exceeds the scheduler's --max-kv-blocks {self.config.max_kv_blocks}"
        return kv_cache_groups_problem(msg.kv_cache_groups)

    def on_lora_status(self, executor_id: str, msg: xpb.LoraStatus) -> None:
        if self.loras is not None and executor_id in self.executors:
            self.loras.on_status(executor_id, msg.name, msg.error)

    def on_heartbeat(self, executor_id: str, msg: xpb.Heartbeat) -> None:
        handle = self.executors.get(executor_id)
        if handle is not None:
            handle.last_seen = time.monotonic()
        elif executor_id not in self._shut_down:  # we restarted, or declared it dead: it must register anew
            asyncio.ensure_future(self.link.send(executor_id, self._config_message()))

    def on_goodbye(self, executor_id: str, msg: xpb.Goodbye) -> None:
        handle = self.executors.get(executor_id)
        if handle is not None:
            self.kill(handle, f"said goodbye: {msg.reason}", blame=False)

    def kill(self, handle: ExecutorHandle, why: str, blame: bool = True) -> None:
        """Retire `handle`; the engine gets its unfinished requests, tokens so far kept.

        `blame`: it failed (not a goodbye): the requests of its steps in flight are `suspects`
        (the engine's poison-pill guard counts them).
        """
        if not handle.alive:
            return
        log.warning("executor %s is gone (%s); moving its requests", handle.executor_id, why)
        if blame:
            handle.suspects = frozenset().union(*handle.scheduled.values())
        self._on_lost(handle, self._retire(handle))

    def _retire(self, handle: ExecutorHandle) -> list[Request] | list[PoolingRequest]:
        handle.alive = False
        if self.executors.get(handle.executor_id) is handle:
            del self.executors[handle.executor_id]
        for future in handle.pending.values():
            future.cancel()
        handle.pending.clear()
        handle.scheduled.clear()
        if handle.task is not None and handle.task is not asyncio.current_task():
            handle.task.cancel()
        handle.wakeup.set()
        self.num_preemptions_retired += handle.scheduler.stats().num_preemptions
        return handle.scheduler.drain()

    def check_heartbeats(self, now: float, loop_stalled: bool, tick: float) -> None:
        if loop_stalled:
            # Our own loop stalled: heartbeats may sit unread in the socket. Judge nobody on it.
            for handle in self.executors.values():
                handle.last_seen = max(handle.last_seen, now - tick)
        for handle in list(self.executors.values()):
            if now - handle.last_seen > self.config.executor_timeout_s:
                self.kill(handle, f"no heartbeat for {now - handle.last_seen:.1f} s")


def kv_cache_groups_problem(groups) -> str:
    """Why a Register's KV cache groups cannot be served ("" if they can): bounded, each layer once."""
    if len(groups) > MAX_KV_CACHE_GROUPS:
        return f"kv_cache_groups: {len(groups)} groups, at most {MAX_KV_CACHE_GROUPS}"
    layers = [layer for group in groups for layer in group.layer_ids]
    if len(layers) > MAX_KV_CACHE_LAYERS:
        return f"kv_cache_groups: {len(layers)} layers, at most {MAX_KV_CACHE_LAYERS}"
    if len(set(layers)) != len(layers) or any(not group.layer_ids for group in groups):
        return "kv_cache_groups: every group needs layers, and no layer may be in two groups"
    return ""
