"""The scheduler service's engine: one waiting queue, executors bound late, a step loop each.

    Generate ─submit─▶ owners (samples | beam search) ─▶ WaitingQueue (fair across tenants)
                                                             │ _dispatch: bind to an executor
                                                             ▼ that can admit now (ExecutorPool.choose)
        per executor: schedule() ─▶ StepPlan ─ZeroMQ─▶ executor ─▶ StepResult ─▶ update_from_output
                          ▲   one step planned ahead (async scheduling)          │
                          └──────────── owners.on_update ◀── RequestUpdate ◀─────┘

Late binding: a request waits in the engine's queue until an executor can admit it
(room under max_num_seqs, free blocks for its first chunk); then it joins that
executor's core scheduler, which keeps it while it runs. A request the core preempts,
or that an executor lost (`ExecutorPool.on_lost`), comes back to the queue with its
tokens so far and resumes wherever there is room first, prefix-aware. So an executor
that joins under load takes queued work in its first steps.

Tenants. A client request is known by (tenant, request_id): the tenant of the caller's API
key (`scheduler_svc.auth.current_tenant()`; "" when keys are off) and its id. So a tenant
cannot collide with, see (ALREADY_EXISTS) or abort another tenant's requests, and its core
requests are named `<i>:<request_id>-<serial>`, unique whoever sent them. Each tenant has
at most `max_requests_per_tenant` requests running or waiting (RESOURCE_EXHAUSTED past
it, checked before any work); tenant "" (no keys) is not limited but by the queue bound.

Each executor's step loop is three calls, as vLLM's `EngineCore.step`: schedule, execute,
update. With async scheduling (the default) step N+1 is planned and sent while step N
runs, so the executor never waits for the scheduler between steps; the tokens of step N
are placeholders in step N+1's plan (see `scheduler_svc.core.scheduler`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections import Counter, deque
from typing import Callable

from transformers import PreTrainedTokenizerBase

from pagoda import __version__
from pagoda.link_security import LinkKeys
from pagoda.step import GRAMMAR_FAILED, GRAMMAR_PENDING, StepPlan, StepResult
from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.auth import current_tenant, prefix_cache_salt
from scheduler_svc.client_stream import ClientStream
from scheduler_svc.core import AllBlocksCleared, FinishReason, KVCacheEvent, Request, SchedulerStats, fit_error
from scheduler_svc.errors import AlreadyExists, Internal, InvalidArgument, ResourceExhausted, Unavailable
from scheduler_svc.executor_pool import (  # noqa: F401  (re-exported: the engine's public config)
    DEFAULT_CPU_STEP_BUDGET,
    DEFAULT_GPU_STEP_BUDGET,
    EngineConfig,
    ExecutorHandle,
    ExecutorPool,
)
from scheduler_svc.lora_registry import LoraRegistry
from scheduler_svc.metrics import ExecutorSnapshot, EngineSnapshot, Metrics
from scheduler_svc.owners import BeamOwner, Owners, SampleOwner, initial_requests, owners_for
from scheduler_svc.pooling_stream import PoolOwner, PoolParams, PoolStream
from scheduler_svc.validation import GenerateParams
from scheduler_svc.waiting_queue import WaitingQueue

log = logging.getLogger(__name__)

RequestKey = tuple[str, str]  # (tenant, request_id): who may see, collide with or abort a request

# A request in a step in flight on this many failed executors is ended, not restarted (#16).
MAX_EXECUTOR_LOSSES = 2
# A constrained request whose grammar is still compiling on its executor is bound again this much
# later, for at most this long (the executor's own compile bound is 30 s: it fails it before).
GRAMMAR_RETRY_S = 0.2
GRAMMAR_WAIT_LIMIT_S = 60.0


def _constraint_field(owner) -> str:
    constraint = owner.stream.params.sampling.constraint
    return constraint.field if constraint is not None else "constraint"


class Engine:
    def __init__(
        self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase, bind: str, link_keys: LinkKeys | None = None
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = Metrics(self.snapshot)
        self.pool = ExecutorPool(config, bind, self.metrics, self._on_joined, self._on_lost, link_keys)
        self.queue = WaitingQueue()
        self.requests: dict[RequestKey, list[SampleOwner] | list[BeamOwner] | list[PoolOwner]] = {}  # (tenant, request_id) -> owners
        self.owners = Owners()  # core request id -> owner
        self.on_health_change: Callable[[bool], None] = lambda serving: None
        # (executor id, its prefix cache's events), after each step: the KV-event stream's source
        self.on_kv_events: Callable[[str, list[KVCacheEvent]], None] = lambda executor_id, events: None
        self._tasks: list[asyncio.Task] = []
        self._strikes: dict[RequestKey, int] = {}  # client request -> failed executors it was in a step of
        self._grammar_waits: dict[str, float] = {}  # core request id -> since when it waits for its grammar
        self._num_requests_of: Counter[str] = Counter()  # tenant -> its requests in self.requests
        self._requests_of_adapter: Counter[str] = Counter()  # LoRA adapter -> its requests in self.requests
        self.loras: LoraRegistry | None = None  # `enable_loras`
        self._serial = itertools.count()
        self.draining = False  # set on SIGTERM: streams in flight finish, new requests are refused

    # ---- life cycle -------------------------------------------------------------------
    def enable_loras(self, base_name: str, max_cpu_loras: int) -> LoraRegistry:
        """LoRA adapters (the config's `enable_lora`): the registry every executor learns them from."""
        alive = lambda: [h.executor_id for h in self.pool.alive]  # noqa: E731
        self.loras = LoraRegistry(
            self.config.max_lora_rank, max_cpu_loras, base_name, alive, self.pool.link.send,
            lambda name: self._requests_of_adapter[name] > 0,
        )
        self.pool.loras = self.loras
        return self.loras

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self.pool.link.serve()), asyncio.create_task(self._monitor())]

    def drain(self) -> None:
        """Refuse new requests from now on; those in flight run on (the grace period)."""
        self.draining = True
        self.on_health_change(False)

    async def stop(self) -> None:
        await self.pool.stop()
        for task in self._tasks:
            task.cancel()

    @property
    def serving(self) -> bool:
        return bool(self.pool.alive)

    # ---- requests -----------------------------------------------------------------------
    def submit(self, params: GenerateParams, tenant: str | None = None) -> ClientStream:
        """Admit a validated request of `tenant` or raise; its stream is `stream.responses()`.

        `tenant` defaults to the caller's (`current_tenant()`, set by the API-key interceptor).
        The tenant also salts the request's prefix-cache hashes, so tenants never share blocks.
        """
        tenant = current_tenant() if tenant is None else tenant
        self.check_admission(tenant)
        key = (tenant, params.request_id)
        if key in self.requests:
            raise AlreadyExists(f"request_id: {params.request_id!r} is already in flight")
        if params.beam_width > 1 and self.config.speculative is not None:
            raise InvalidArgument(
                "sampling.beam_width",
                "beam search does not run with speculative decoding; this server drafts tokens (--num-speculative-tokens)",
            )
        max_tokens = self._max_tokens(params)
        params = dataclasses.replace(params, cache_salt=prefix_cache_salt(tenant, params.cache_salt))
        stream = ClientStream.create(params, self.tokenizer, tenant=tenant, core_id=f"{params.request_id}-{next(self._serial)}")
        owners = owners_for(stream, max_tokens, self.metrics, vocab_size=len(self.tokenizer))
        self.requests[key] = owners
        self._num_requests_of[tenant] += 1
        if params.lora:
            self._requests_of_adapter[params.lora] += 1
        group = initial_requests(owners)
        for owner, request in zip(owners, group, strict=True):
            self.owners.claim([request.req_id], owner)
        self.queue.push(group, tenant)
        self._dispatch()
        return stream

    def submit_pooling(self, params: PoolParams, tenant: str | None = None) -> PoolStream:
        """Admit a validated pooling request (Embed, Rerank) of `tenant` or raise; await `stream.result()`.

        The same admission as `submit` (the tenant's share, the queue, in-flight ids); each input
        is then one turn in the fair queue, bound to whichever executor has room (late binding).
        """
        tenant = current_tenant() if tenant is None else tenant
        self.check_admission(tenant)
        key = (tenant, params.request_id)
        if key in self.requests:
            raise AlreadyExists(f"request_id: {params.request_id!r} is already in flight")
        stream = PoolStream(params, tenant=tenant, core_id=f"{params.request_id}-{next(self._serial)}")
        owners = PoolOwner.for_inputs(stream)
        self.requests[key] = owners
        self._num_requests_of[tenant] += 1
        for owner in owners:
            self.owners.claim([owner.request.req_id], owner)
            self.queue.push([owner.request], tenant)
        self._dispatch()
        return stream

    def check_admission(self, tenant: str | None = None) -> None:
        """Raise unless a new request of `tenant` (default: the caller's) may be admitted now.

        Cheap: servicers call it before any work (tokenizing), and `submit` again.
        """
        tenant = current_tenant() if tenant is None else tenant
        if self.draining:
            raise Unavailable("the server is shutting down; retry on another replica")
        limit = self.config.max_requests_per_tenant
        if tenant and limit and self._num_requests_of[tenant] >= limit:
            raise ResourceExhausted(
                f"this API key's tenant has {limit} requests running or waiting, its share "
                f"(--max-requests-per-tenant {limit}); retry when one has finished"
            )
        if self.num_waiting() >= self.config.max_waiting_requests:
            raise ResourceExhausted(
                f"the waiting queue is full ({self.config.max_waiting_requests} requests); retry later"
            )

    def abort(self, request_id: str, reason: int = pb.FINISH_REASON_ABORTED, *, tenant: str | None = None) -> None:
        """Idempotent: unknown or finished ids are ignored. Frees the blocks at once.

        Only `tenant`'s request of that id (default: the caller's tenant) is aborted.
        """
        tenant = current_tenant() if tenant is None else tenant
        owners = self.requests.get((tenant, request_id))
        if owners is None:
            return
        for owner in owners:
            self._drop_core_requests(owner.live_req_ids)
            owner.abort(reason, self.owners)
        self._close(owners[0].stream)

    def num_waiting(self) -> int:
        return sum(h.scheduler.num_waiting for h in self.pool.alive) + self.queue.num_requests

    def reset_prefix_cache(self) -> bool:
        """Empty every executor's prefix cache if no request is anywhere (True); else change nothing."""
        busy = any(h.scheduler.has_unfinished() or h.scheduler.num_steps_in_flight for h in self.pool.alive)
        if self.requests or self.queue.entries or busy:
            return False
        for handle in self.pool.alive:
            handle.scheduler.reset_prefix_cache()
            self._publish_kv_events(handle)
        return True

    def _publish_kv_events(self, handle: ExecutorHandle) -> None:
        events = handle.scheduler.take_kv_events()
        if events:
            self.on_kv_events(handle.executor_id, events)

    def snapshot(self) -> EngineSnapshot:
        """The live figures, for metrics and GetServerInfo."""
        return EngineSnapshot(
            executors=[ExecutorSnapshot(h.executor_id, h.device, h.alive, h.scheduler.stats(), h.weight_bytes) for h in self.pool.alive],
            num_queued=self.queue.num_requests,
            num_preemptions_retired=self.pool.num_preemptions_retired,
        )

    def server_info(self) -> pb.ServerInfo:
        snap = self.snapshot()
        info = pb.ServerInfo(version=__version__, num_preemptions=snap.num_preemptions, num_waiting=snap.num_waiting)
        info.num_running = snap.num_running
        for executor in snap.executors:
            stats: SchedulerStats = executor.stats
            info.executors.append(
                pb.ExecutorInfo(
                    executor_id=executor.executor_id,
                    device=executor.device,
                    healthy=executor.healthy,
                    num_total_blocks=stats.num_total_blocks,
                    num_free_blocks=stats.num_free_blocks,
                    num_cached_blocks=stats.num_cached_blocks,
                    num_running=stats.num_running,
                    num_waiting=stats.num_waiting,
                    kv_slots_allocated=stats.kv_slots_allocated,
                    kv_tokens_held=stats.kv_tokens_held,
                    weight_bytes=executor.weight_bytes,
                )
            )
        return info

    def _max_tokens(self, params: GenerateParams) -> int:
        """The request's token limit; InvalidArgument if no registered executor could ever hold it."""
        prompt_len = len(params.prompt_token_ids)
        capacity = self.pool.max_seq_len()
        limit = self.config.max_model_len if capacity is None else min(self.config.max_model_len, capacity)
        problem = fit_error(prompt_len, params.max_tokens, limit)
        if problem:
            field_name, message = problem
            raise InvalidArgument(field_name, f"{message}: it can never fit the KV cache of any executor")
        return params.max_tokens if params.max_tokens is not None else limit - prompt_len

    def _drop_core_requests(self, req_ids: list[str]) -> None:
        ids = set(req_ids)
        for req_id in ids:
            self._grammar_waits.pop(req_id, None)
        self.queue.remove(ids)
        for handle in self.pool.alive:
            if handle.scheduler.finish_requests(ids, FinishReason.ABORTED):
                handle.wakeup.set()

    def _close(self, stream: ClientStream | PoolStream) -> None:
        if stream.finish_if_done():
            stream.log_finish(self.metrics)
        owners = self.requests.get(stream.key)
        if stream.done and owners and owners[0].stream is stream:  # (not a newer request of the same key)
            del self.requests[stream.key]
            if stream.params.lora:
                self._requests_of_adapter[stream.params.lora] -= 1
            self._num_requests_of[stream.tenant] -= 1
            if not self._num_requests_of[stream.tenant]:
                del self._num_requests_of[stream.tenant]
            self._strikes.pop(stream.key, None)

    def _fail(self, stream: ClientStream | PoolStream, error: Exception) -> None:
        for owner in self.requests.get(stream.key, ()):
            self._drop_core_requests(owner.live_req_ids)
            self.owners.release(owner.live_req_ids)
        stream.fail(error)
        self._close(stream)

    # ---- binding ------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Bind queued requests, in order, to executors that can admit them now.

        A request no executor could ever hold waits for one that can (or times out in the
        monitor) without holding up the rest; the first that merely has to wait for room
        stops the binding: no overtaking, except past a tenant that holds its share of every
        executor's running slots while another tenant waits (`Scheduler.holds_back`): its
        requests wait, the others' go on. Then every executor learns which tenants still wait
        here (`Scheduler.set_waiting_elsewhere`), to make them room in its next step.
        """
        held_back: dict[str, bool] = {}
        try:
            for entry in self.queue.in_order():
                if not self.pool.can_ever_fit(entry.requests[0].num_tokens + 1):
                    continue
                if entry.tenant in held_back and held_back[entry.tenant]:
                    continue
                handle = self.pool.choose(entry.requests)
                if handle is None:
                    if entry.tenant not in held_back:
                        held_back[entry.tenant] = all(h.scheduler.holds_back(entry.tenant) for h in self.pool.alive)
                    if held_back[entry.tenant]:
                        continue
                    return
                self.queue.take(entry)
                handle.scheduler.add_requests(entry.requests)
                handle.wakeup.set()
        finally:
            heads = self.queue.heads()
            for handle in self.pool.alive:
                handle.scheduler.set_waiting_elsewhere(heads)
                if heads:
                    handle.wakeup.set()

    def _on_joined(self, handle: ExecutorHandle) -> None:
        was_serving = len(self.pool.alive) > 1
        handle.task = asyncio.create_task(self._step_loop(handle))
        handle.task.add_done_callback(lambda task: self._step_loop_ended(handle, task))
        self._dispatch()
        if not was_serving and not self.draining:
            self.on_health_change(True)

    def _on_lost(self, handle: ExecutorHandle, requests: list[Request]) -> None:
        """Queue the unfinished requests of a lost executor again, as their owners say.

        Poison-pill guard: a request in a step in flight on a failed executor gets a strike;
        at MAX_EXECUTOR_LOSSES it ends with INTERNAL instead of bringing down another one.
        """
        self.on_kv_events(handle.executor_id, [AllBlocksCleared()])  # its cache went with it
        struck: set[str] = set()
        for request in requests:
            owner = self.owners.get(request.req_id)
            if owner is not None and request.req_id in handle.suspects and owner.stream.request_id not in struck:
                struck.add(owner.stream.request_id)
                if self._strike(owner.stream):
                    continue
            if owner is not None:
                group = owner.on_executor_lost(request, self.owners)
                if group:
                    self.queue.push(group, owner.stream.tenant)
        if not self.serving:
            self.on_health_change(False)
        self._dispatch()

    def _strike(self, stream: ClientStream) -> bool:
        """Count one failed executor against `stream`; True if that ended it."""
        strikes = self._strikes[stream.key] = self._strikes.get(stream.key, 0) + 1
        if strikes < MAX_EXECUTOR_LOSSES:
            return False
        log.error("request %r was in the steps of %d failed executors: ending it", stream.request_id, strikes)
        self.metrics.request_errors.labels("poison_pill").inc()
        self._fail(stream, Internal(
            f"request {stream.request_id!r} brought down {strikes} executors (their steps with it failed or never "
            f"returned); it is not retried"
        ))
        return True

    def _fail_request_errors(self, handle: ExecutorHandle, result: StepResult) -> None:
        """End each request its executor pinned an error on (NaN logits, a sampler failure) with INTERNAL.

        Structured output: a request whose grammar is still compiling on the executor
        (GRAMMAR_PENDING) is taken out of it and bound again GRAMMAR_RETRY_S later
        (`_update`), for at most GRAMMAR_WAIT_LIMIT_S; one whose grammar failed to compile
        there (GRAMMAR_FAILED: over the executor's bounds) ends with INVALID_ARGUMENT naming
        its constraint.
        """
        for error in result.errors:
            owner = self.owners.get(error.req_id)
            if error.message.startswith(GRAMMAR_PENDING) and owner is not None and not owner.stream.done:
                waited = time.monotonic() - self._grammar_waits.setdefault(error.req_id, time.monotonic())
                if waited < GRAMMAR_WAIT_LIMIT_S:
                    handle.scheduler.defer(error.req_id)
                    continue
                self._grammar_waits.pop(error.req_id, None)
                handle.scheduler.finish_requests({error.req_id}, FinishReason.ABORTED)
                self._fail(owner.stream, InvalidArgument(
                    _constraint_field(owner), f"did not compile on executor {handle.executor_id} within {GRAMMAR_WAIT_LIMIT_S:g} s"
                ))
                continue
            handle.scheduler.finish_requests({error.req_id}, FinishReason.ABORTED)
            self._grammar_waits.pop(error.req_id, None)
            if owner is None or owner.stream.done:
                continue
            if error.message.startswith(GRAMMAR_FAILED):
                _, _, why = error.message.removeprefix(GRAMMAR_FAILED).partition(": ")
                self._fail(owner.stream, InvalidArgument(_constraint_field(owner), f"{why} (executor {handle.executor_id})"))
                continue
            log.error("request %r failed on executor %s: %r", owner.stream.request_id, handle.executor_id, error.message)
            self.metrics.request_errors.labels("executor_error").inc()
            self._fail(owner.stream, Internal(
                f"request {owner.stream.request_id!r} failed on executor {handle.executor_id}: {error.message}"
            ))

    # ---- step loop ----------------------------------------------------------------------
    async def _step_loop(self, handle: ExecutorHandle) -> None:
        """schedule -> execute -> update, with up to one step planned ahead of the last result."""
        ahead = 1 if self.config.async_scheduling and self.config.speculative is None else 0
        in_flight: deque[tuple[StepPlan, asyncio.Future]] = deque()
        await self.pool.send_registered(handle)
        if self.loras is not None:  # every adapter, before its first step
            await self.loras.send_all(handle.executor_id)
        while handle.alive:
            if len(in_flight) <= ahead:
                plan = handle.scheduler.schedule()
                if plan.num_scheduled_tokens or plan.finished_req_ids or plan.block_copies or plan.pool_requests:
                    in_flight.append((plan, await self.pool.execute(handle, plan)))
                    continue
            if in_flight:
                plan, future = in_flight.popleft()
                try:
                    result: StepResult = await asyncio.wait_for(future, self.config.step_timeout_s)
                except asyncio.CancelledError:
                    return
                except TimeoutError:
                    self.pool.judge_hung(handle, plan.step_id)
                    return
                if handle.alive:
                    self._update(handle, plan, result)
                continue
            await self._idle(handle)

    async def _idle(self, handle: ExecutorHandle) -> None:
        handle.wakeup.clear()
        if handle.scheduler.has_unfinished():
            # Work that cannot be scheduled yet: look again shortly.
            try:
                await asyncio.wait_for(handle.wakeup.wait(), 0.05)
            except TimeoutError:
                pass
        else:
            await handle.wakeup.wait()

    def _update(self, handle: ExecutorHandle, plan: StepPlan, result: StepResult) -> None:
        """Apply one step: tokens to their owners, preempted requests back to the queue."""
        scheduler = handle.scheduler
        try:
            updates = scheduler.update_from_output(plan, result)
        except ValueError as exc:  # a result that does not answer the plan; the core changed nothing
            self.pool.reject(handle, str(exc))
            return
        self._fail_request_errors(handle, result)
        for update in updates:
            owner = self.owners.get(update.req_id)
            if owner is None:
                continue
            owner.on_update(scheduler, update, self.owners)
            if owner.done:
                self._close(owner.stream)
        self.metrics.observe_spec_decode(scheduler.take_spec_decode_stats())
        self._publish_kv_events(handle)
        if self._grammar_waits:
            for update in updates:
                self._grammar_waits.pop(update.req_id, None)  # its grammar was ready: it sampled
        for request in scheduler.take_movable():
            owner = self.owners.get(request.req_id)
            if request.req_id in self._grammar_waits:  # bound again a little later, not at once
                asyncio.get_running_loop().call_later(GRAMMAR_RETRY_S, self._requeue, request)
                continue
            self.queue.push([request], owner.stream.tenant if owner is not None else "")
        self._dispatch()

    def _requeue(self, request: Request) -> None:
        """A request that waited for its grammar: queued again, unless it ended meanwhile."""
        owner = self.owners.get(request.req_id)
        if owner is None or owner.stream.done or request.is_finished or request.req_id not in self._grammar_waits:
            return
        self.queue.push([request], owner.stream.tenant)
        self._dispatch()

    def _step_loop_ended(self, handle: ExecutorHandle, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error("step loop of executor %s failed", handle.executor_id, exc_info=task.exception())
        self.pool.kill(handle, "step loop failed")

    # ---- monitor ------------------------------------------------------------------------
    async def _monitor(self) -> None:
        tick = 0.2
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            self.pool.check_heartbeats(now, now - last > self.config.executor_timeout_s / 2, tick)
            last = now
            self._expire_unservable(now)

    def _expire_unservable(self, now: float) -> None:
        """Requests that no executor could hold for `no_executor_wait_s` end with UNAVAILABLE."""
        for entry in list(self.queue.entries):
            if self.pool.can_ever_fit(entry.requests[0].num_tokens + 1):
                entry.stuck_since = None
                continue
            entry.stuck_since = entry.stuck_since or now
            if now - entry.stuck_since < self.config.no_executor_wait_s:
                continue
            owner = self.owners.get(entry.requests[0].req_id)
            if owner is not None and not owner.stream.done:
                self._fail(
                    owner.stream,
                    Unavailable(
                        f"no executor could serve request {owner.stream.request_id!r} "
                        f"within {self.config.no_executor_wait_s:g} s"
                    ),
                )
