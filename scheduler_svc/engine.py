"""The scheduler service's engine: executors, routing, step loops and request streams.

    Generate ──submit──▶ RequestState ──route──▶ ExecutorHandle.scheduler (core, pure Python)
                             ▲                         │ schedule() ─▶ StepPlan ─▶ ZeroMQ
                             └── on_token ◀── update_from_output ◀── StepResult ◀┘

Everything runs on one asyncio loop: each executor has a step loop (schedule, send, await
the result, update, emit tokens) and a monitor task declares executors dead when their
heartbeats stop. A dead executor's requests are drained from its core with their tokens
so far and placed on a survivor (recompute), so their streams continue unbroken; with no
executor left they wait up to `no_executor_wait_s`, then end with UNAVAILABLE.

A beam search (`beam_width` > 1) is a `BeamSearch` whose live beams are the core
requests: each step's beam tokens go to it, and each finished generation is applied
to the core as finishes and forks; its n best sequences are emitted when it ends. If
its executor dies, its live beams restart together on another (`BeamSearch.restart`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from transformers import PreTrainedTokenizerBase

from pagoda import __version__, wire
from pagoda.step import StepResult
from pagoda.v1 import executor_pb2 as xpb
from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.beam_search import BeamSearch, BeamSearchParams, apply_beam_step
from scheduler_svc.core.request import FinishReason, Request
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.errors import AlreadyExists, InvalidArgument, ResourceExhausted, Unavailable
from scheduler_svc.link import ExecutorLink
from scheduler_svc.metrics import Metrics
from scheduler_svc.request_state import RequestState, SampleStream
from scheduler_svc.validation import GenerateParams

log = logging.getLogger(__name__)

_U64 = 2**64


def _prefix_routing_slack(least_load: int) -> int:
    """How many more requests than the least loaded executor one may hold and still win on a prefix hit."""
    return max(1, least_load // 4)


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
    executor_timeout_s: float = 2.0
    no_executor_wait_s: float = 30.0

    def __post_init__(self):
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "max_waiting_requests"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.executor_timeout_s <= 0 or self.no_executor_wait_s < 0:
            raise ValueError("executor_timeout_s must be positive and no_executor_wait_s not negative")

    def step_budget(self, device: str) -> int:
        """Tokens one step of an executor on `device` ("cpu", "cuda:0", ...) may compute."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_CPU_STEP_BUDGET if device.split(":")[0] == "cpu" else DEFAULT_GPU_STEP_BUDGET


@dataclass
class ExecutorHandle:
    executor_id: str
    device: str
    scheduler: Scheduler
    last_seen: float
    alive: bool = True
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    pending: asyncio.Future | None = None
    pending_step_id: int = -1
    task: asyncio.Task | None = None

    @property
    def capacity_tokens(self) -> int:
        return self.scheduler.config.max_seq_len

    def load(self) -> tuple[int, int]:
        stats = self.scheduler.stats()
        return (stats.num_running + stats.num_waiting, -stats.num_free_blocks)


@dataclass
class _Placement:
    state: RequestState
    sample: SampleStream
    request: Request


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase, bind: str):
        self.config = config
        self.tokenizer = tokenizer
        self.link = ExecutorLink(bind, self)
        self.executors: dict[str, ExecutorHandle] = {}
        self.requests: dict[str, RequestState] = {}
        self._placements: dict[str, _Placement] = {}  # core req id -> where it belongs
        self._location: dict[str, ExecutorHandle] = {}  # core req id -> executor holding it
        self._beam_states: dict[str, RequestState] = {}  # core req id of a live beam -> its request
        self._orphans: list[tuple[float, Request]] = []  # (deadline, request) waiting for an executor
        self.metrics = Metrics()
        self.metrics.attach(self)
        self.num_preemptions_retired = 0  # preemptions counted by executors that are gone
        self.on_health_change: Callable[[bool], None] = lambda serving: None
        self._tasks: list[asyncio.Task] = []

    # ---- life cycle -------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self.link.serve()), asyncio.create_task(self._monitor())]

    async def stop(self) -> None:
        for handle in list(self.executors.values()):
            await self.link.send(handle.executor_id, xpb.SchedulerMessage(shutdown=xpb.Shutdown(reason="scheduler stopping")))
            self._retire(handle)
        for task in self._tasks:
            task.cancel()
        self.link.close()

    @property
    def serving(self) -> bool:
        return bool(self.executors)

    # ---- requests -----------------------------------------------------------------------
    def submit(self, params: GenerateParams) -> RequestState:
        """Admit a validated request or raise; its stream is `state.responses()`."""
        if params.request_id in self.requests:
            raise AlreadyExists(f"request_id: {params.request_id!r} is already in flight")
        if self.num_waiting() >= self.config.max_waiting_requests:
            raise ResourceExhausted(
                f"the waiting queue is full ({self.config.max_waiting_requests} requests); retry later"
            )
        max_tokens = self._max_tokens(params)
        state = RequestState.create(params, self.tokenizer)
        self.requests[params.request_id] = state
        if params.beam_width > 1:
            self._submit_beam_search(state, max_tokens)
            return state
        for i, sample in enumerate(state.samples):
            request = Request(
                req_id=sample.core_req_id,
                prompt_token_ids=list(params.prompt_token_ids),
                sampling=_sample_sampling(params, i),
                max_tokens=max_tokens,
                eos_token_ids=params.eos_token_ids,
                priority=params.priority,
                arrival_time=time.monotonic(),
            )
            self._placements[sample.core_req_id] = _Placement(state, sample, request)
        self._place_group([self._placements[s.core_req_id].request for s in state.samples])
        return state

    def abort(self, request_id: str, reason: int = pb.FINISH_REASON_ABORTED) -> None:
        """Idempotent: unknown or finished ids are ignored. Frees the blocks at once."""
        state = self.requests.get(request_id)
        if state is None:
            return
        self._drop_beams(state)
        for sample in state.samples:
            if not sample.finished:
                self._drop_core_request(sample.core_req_id, FinishReason.ABORTED)
                state.finish_sample(sample, reason)
        self._close(state)

    def num_waiting(self) -> int:
        return sum(h.scheduler.stats().num_waiting for h in self.executors.values()) + len(self._orphans)

    def server_info(self) -> pb.ServerInfo:
        info = pb.ServerInfo(version=__version__)
        info.num_preemptions = self.num_preemptions_retired
        info.num_waiting = len(self._orphans)
        for handle in self.executors.values():
            stats = handle.scheduler.stats()
            info.num_running += stats.num_running
            info.num_waiting += stats.num_waiting
            info.num_preemptions += stats.num_preemptions
            info.executors.append(
                pb.ExecutorInfo(
                    executor_id=handle.executor_id,
                    device=handle.device,
                    healthy=handle.alive,
                    num_total_blocks=stats.num_total_blocks,
                    num_free_blocks=stats.num_free_blocks,
                    num_cached_blocks=stats.num_cached_blocks,
                    num_running=stats.num_running,
                    num_waiting=stats.num_waiting,
                    kv_slots_allocated=stats.kv_slots_allocated,
                    kv_tokens_held=stats.kv_tokens_held,
                )
            )
        return info

    def _max_tokens(self, params: GenerateParams) -> int:
        prompt_len = len(params.prompt_token_ids)
        if params.max_tokens is not None:
            need = prompt_len + params.max_tokens
            if self.executors and not any(h.scheduler.can_fit(need) for h in self.executors.values()):
                raise InvalidArgument(
                    "stopping.max_tokens",
                    f"prompt + max_tokens = {need} tokens can never fit the KV cache of any executor "
                    f"(largest holds {max(h.capacity_tokens for h in self.executors.values())} tokens)",
                )
            return params.max_tokens
        limit = self.config.max_model_len
        if self.executors:
            limit = min(limit, max(h.capacity_tokens for h in self.executors.values()))
        if prompt_len >= limit:
            raise InvalidArgument("prompt", f"{prompt_len} tokens can never fit the KV cache ({limit} tokens)")
        return limit - prompt_len

    # ---- placement --------------------------------------------------------------------
    def _place_group(self, requests: list[Request]) -> None:
        handle = self._route(requests[0])
        if handle is None:
            deadline = time.monotonic() + self.config.no_executor_wait_s
            self._orphans.extend((deadline, r) for r in requests)
            return
        for request in requests:
            self._location[request.req_id] = handle
        handle.scheduler.add_requests(requests)
        handle.wakeup.set()

    def _route(self, request: Request) -> ExecutorHandle | None:
        """The executor caching most of the prompt, else the least loaded one; None if none can hold it.

        A prefix hit counts only on executors about as loaded as the least loaded one
        (`_prefix_routing_slack`): a prefix that every prompt shares, like a chat template's
        system prompt, would otherwise send all work to the first executor that cached it.
        """
        fits = [h for h in self.executors.values() if h.alive and h.scheduler.can_fit(request.num_tokens + 1)]
        if not fits:
            return None
        least = min(h.load()[0] for h in fits)
        near = [h for h in fits if h.load()[0] <= least + _prefix_routing_slack(least)]
        hits = {h.executor_id: h.scheduler.kv_cache_manager.num_prefix_cached_tokens(request.all_token_ids) for h in near}
        best_hit = max(hits.values())
        if best_hit > 0:
            self.metrics.routing.labels("prefix_hit").inc()
            candidates = [h for h in near if hits[h.executor_id] == best_hit]
        else:
            self.metrics.routing.labels("least_loaded").inc()
            candidates = fits
        return min(candidates, key=ExecutorHandle.load)

    def _drop_core_request(self, core_req_id: str, reason: FinishReason) -> None:
        handle = self._location.pop(core_req_id, None)
        if handle is not None:
            handle.scheduler.finish_requests([core_req_id], reason)
            handle.wakeup.set()
        self._orphans = [(d, r) for d, r in self._orphans if r.req_id != core_req_id]

    def _close(self, state: RequestState) -> None:
        if state.finish_if_done():
            reasons = [s.finish_reason for s in state.samples]
            log.info(
                "request %s finished: %s tokens, reasons %s",
                state.request_id, [s.num_tokens for s in state.samples], [pb.FinishReason.Name(r) for r in reasons],
            )
            self.metrics.observe_finish(state.arrival, len(state.params.prompt_token_ids), reasons)
        if state.done:
            self.requests.pop(state.request_id, None)
            for sample in state.samples:
                self._placements.pop(sample.core_req_id, None)
                self._location.pop(sample.core_req_id, None)

    # ---- step loop --------------------------------------------------------------------
    async def _step_loop(self, handle: ExecutorHandle) -> None:
        loop = asyncio.get_running_loop()
        # Registered goes out before the first plan: until it has it, an executor drops plans.
        await self.link.send(handle.executor_id, xpb.SchedulerMessage(registered=xpb.Registered(scheduler_id="pagoda")))
        while handle.alive:
            plan = handle.scheduler.schedule()
            if not plan.num_scheduled_tokens and not plan.finished_req_ids and not plan.block_copies:
                handle.wakeup.clear()
                if handle.scheduler.has_unfinished():
                    # Waiting work that cannot be scheduled yet: look again shortly.
                    try:
                        await asyncio.wait_for(handle.wakeup.wait(), 0.05)
                    except TimeoutError:
                        pass
                else:
                    await handle.wakeup.wait()
                continue
            handle.pending = loop.create_future()
            handle.pending_step_id = plan.step_id
            log.debug("executor %s step %d: %s", handle.executor_id, plan.step_id, plan.num_scheduled_tokens)
            if not await self.link.send_plan(handle.executor_id, plan):
                self._kill(handle, "unreachable")
                return
            try:
                result: StepResult = await handle.pending
            except asyncio.CancelledError:
                return
            finally:
                handle.pending = None
            if not handle.alive:
                return
            self._apply(handle, handle.scheduler.update_from_output(plan, result))

    def _step_loop_ended(self, handle: ExecutorHandle, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error("step loop of executor %s failed", handle.executor_id, exc_info=task.exception())
        if handle.alive:
            self._kill(handle, "step loop failed")

    def _apply(self, handle: ExecutorHandle, updates) -> None:
        for update in updates:
            if update.req_id in self._beam_states:
                self._apply_beam(handle, update)
                continue
            placement = self._placements.get(update.req_id)
            if placement is None:
                continue
            state, sample = placement.state, placement.sample
            if update.sampled is None:
                if update.finish_reason is not None:
                    state.finish_sample(sample, int(update.finish_reason))
                    self._location.pop(update.req_id, None)
                    self._close(state)
                continue
            self._observe_token(state, sample, placement.request)
            reason = int(update.finish_reason) if update.finish_reason is not None else None
            matched = state.on_token(sample, update.sampled, reason)
            if matched is not None and update.finish_reason is None:
                handle.scheduler.finish_requests([update.req_id], FinishReason.STOP_SEQUENCE)
            if sample.finished:
                self._location.pop(update.req_id, None)
                self._close(state)

    def _observe_token(self, state: RequestState, sample: SampleStream, request: Request) -> None:
        now = time.monotonic()
        metrics = self.metrics
        if sample.num_tokens == 0:
            if sample.index == 0:
                state.num_cached_tokens = request.num_cached_tokens
                metrics.ttft.observe(now - state.arrival)
                metrics.prefix_queries.inc(len(state.params.prompt_token_ids))
                metrics.prefix_hits.inc(request.num_cached_tokens)
        else:
            metrics.itl.observe(now - sample.last_token_time)
        sample.last_token_time = now
        metrics.generation_tokens.inc()

    # ---- beam search --------------------------------------------------------------------
    def _submit_beam_search(self, state: RequestState, max_tokens: int) -> None:
        params, sampling = state.params, state.params.sampling
        search = BeamSearch(
            request_id=params.request_id,
            prompt_token_ids=list(params.prompt_token_ids),
            params=BeamSearchParams(
                beam_width=params.beam_width,
                max_tokens=max_tokens,
                n=params.n,
                stop_token_ids=frozenset(sampling.stop_token_ids),
                eos_token_ids=params.eos_token_ids,
                min_tokens=sampling.min_tokens,
                logprobs=sampling.logprobs,
                top_logprobs=sampling.top_logprobs,
            ),
            priority=params.priority,
            arrival_time=time.monotonic(),
        )
        state.beam_search = search
        self._place_beams(state, [search.root()])

    def _place_beams(self, state: RequestState, requests: list[Request]) -> None:
        for request in requests:
            self._beam_states[request.req_id] = state
        self._place_group(requests)

    def _apply_beam(self, handle: ExecutorHandle, update) -> None:
        """A beam's candidates; once its generation is complete, finish and fork beams in the core."""
        state = self._beam_states[update.req_id]
        search = state.beam_search
        if update.sampled is None or search is None:
            return
        if search.generation == 0:
            root = handle.scheduler.get_request(update.req_id)
            state.num_cached_tokens = root.num_cached_tokens if root is not None else 0
        beam_step = search.on_sampled(update.sampled)
        if beam_step is None:
            return
        for req_id in [*beam_step.finished_req_ids, *(parent_id for parent_id, _ in beam_step.forks)]:
            self._beam_states.pop(req_id, None)
            self._location.pop(req_id, None)
        apply_beam_step(handle.scheduler, beam_step)
        for _, children in beam_step.forks:
            for child in children:
                self._beam_states[child.req_id] = state
                self._location[child.req_id] = handle
        handle.wakeup.set()
        if beam_step.done:
            self._emit_beam_results(state)

    def _emit_beam_results(self, state: RequestState) -> None:
        assert state.beam_search is not None
        self.metrics.ttft.observe(time.monotonic() - state.arrival)
        self.metrics.prefix_queries.inc(len(state.params.prompt_token_ids))
        self.metrics.prefix_hits.inc(state.num_cached_tokens)
        for sample, hypothesis in zip(state.samples, state.beam_search.best()):
            tokens = list(hypothesis.output_token_ids)
            state.emit_sequence(sample, tokens, list(hypothesis.logprobs), int(hypothesis.finish_reason))
            self.metrics.generation_tokens.inc(len(tokens))
        self._close(state)

    def _restart_beams(self, state: RequestState) -> None:
        """The live beams of `state` lost their executor: start them afresh, together, elsewhere."""
        assert state.beam_search is not None
        for req_id in state.beam_search.live_req_ids:
            self._beam_states.pop(req_id, None)
            self._location.pop(req_id, None)
        self._place_beams(state, state.beam_search.restart())

    def _drop_beams(self, state: RequestState) -> None:
        """Finish every live beam of a beam search (abort, failure); no-op for other requests."""
        if state.beam_search is None:
            return
        for req_id in state.beam_search.live_req_ids:
            if self._beam_states.pop(req_id, None) is not None:
                self._drop_core_request(req_id, FinishReason.ABORTED)

    def _orphan_groups(self, orphans: list[tuple[float, Request]]) -> list[list[Request]]:
        """The orphans one by one, except that the beams of one beam search stay together."""
        groups: dict[object, list[Request]] = {}
        for _, request in orphans:
            state = self._beam_states.get(request.req_id)
            key = (state.request_id,) if state is not None else request.req_id
            groups.setdefault(key, []).append(request)
        return list(groups.values())

    # ---- executors --------------------------------------------------------------------
    def on_hello(self, msg: xpb.Hello) -> None:
        asyncio.ensure_future(self.link.send(msg.executor_id, self._config_message()))

    def _config_message(self) -> xpb.SchedulerMessage:
        return xpb.SchedulerMessage(
            config=xpb.ExecutorConfig(
                block_size=self.config.block_size,
                # the largest step this scheduler may plan (a GPU executor profiles its memory with it)
                max_num_batched_tokens=self.config.max_num_batched_tokens or DEFAULT_GPU_STEP_BUDGET,
                max_model_len=self.config.max_model_len,
                model_fingerprint=self.config.model_fingerprint,
            )
        )

    def on_register(self, msg: xpb.Register) -> None:
        problem = self._registration_problem(msg)
        if problem:
            log.error("refusing executor %s: %s", msg.executor_id, problem)
            asyncio.ensure_future(
                self.link.send(msg.executor_id, xpb.SchedulerMessage(shutdown=xpb.Shutdown(reason=problem)))
            )
            return
        old = self.executors.get(msg.executor_id)
        if old is not None:
            self._kill(old, "re-registered")
        budget = self.config.step_budget(msg.device)
        core = Scheduler(
            SchedulerConfig(
                block_size=msg.block_size,
                num_blocks=msg.num_kv_blocks,
                max_num_batched_tokens=budget,
                max_num_seqs=self.config.max_num_seqs,
                max_model_len=self.config.max_model_len,
                enable_prefix_caching=self.config.enable_prefix_caching,
            )
        )
        handle = ExecutorHandle(msg.executor_id, msg.device, core, last_seen=time.monotonic())
        was_serving = self.serving
        self.executors[msg.executor_id] = handle
        handle.task = asyncio.create_task(self._step_loop(handle))
        handle.task.add_done_callback(lambda task: self._step_loop_ended(handle, task))
        log.info(
            "executor %s registered: %s, %d KV blocks, steps of up to %d tokens",
            msg.executor_id, msg.device, msg.num_kv_blocks, budget,
        )
        orphans, self._orphans = self._orphans, []
        for group in self._orphan_groups(orphans):
            self._place_group(group)
        if not was_serving:
            self.on_health_change(True)

    def _registration_problem(self, msg: xpb.Register) -> str:
        if msg.model_fingerprint != self.config.model_fingerprint:
            return f"model fingerprint {msg.model_fingerprint} differs from the scheduler's {self.config.model_fingerprint}"
        if msg.block_size != self.config.block_size:
            return f"block size {msg.block_size} differs from the scheduler's {self.config.block_size}"
        if msg.num_kv_blocks < 2:
            return f"num_kv_blocks {msg.num_kv_blocks} is too small"
        return ""

    def on_heartbeat(self, msg: xpb.Heartbeat) -> None:
        handle = self.executors.get(msg.executor_id)
        if handle is not None:
            handle.last_seen = time.monotonic()
        else:  # we restarted, or declared it dead: it must register anew
            asyncio.ensure_future(self.link.send(msg.executor_id, self._config_message()))

    def on_step_result(self, executor_id: str, msg: xpb.StepResult) -> None:
        handle = self.executors.get(executor_id)
        log.debug("result %s step %d (pending %s)", executor_id, msg.step_id, handle and handle.pending_step_id)
        if handle is None or handle.pending is None or handle.pending.done() or msg.step_id != handle.pending_step_id:
            return
        handle.last_seen = time.monotonic()
        if msg.error:
            log.error("executor %s failed step %d: %s", executor_id, msg.step_id, msg.error)
            self._kill(handle, f"step failed: {msg.error}")
            return
        handle.pending.set_result(wire.result_from_proto(msg))

    def on_goodbye(self, msg: xpb.Goodbye) -> None:
        handle = self.executors.get(msg.executor_id)
        if handle is not None:
            self._kill(handle, f"said goodbye: {msg.reason}")

    def _kill(self, handle: ExecutorHandle, why: str) -> None:
        """Retire `handle` and move its unfinished requests, tokens so far kept, elsewhere."""
        log.warning("executor %s is gone (%s); moving its requests", handle.executor_id, why)
        requests = self._retire(handle)
        beam_searches: dict[str, RequestState] = {}
        for request in requests:
            if request.req_id in self._placements:
                self._place_group([request])
            elif request.req_id in self._beam_states:
                state = self._beam_states[request.req_id]
                beam_searches[state.request_id] = state
        for state in beam_searches.values():
            self._restart_beams(state)
        if not self.serving:
            self.on_health_change(False)

    def _retire(self, handle: ExecutorHandle) -> list[Request]:
        handle.alive = False
        if self.executors.get(handle.executor_id) is handle:
            del self.executors[handle.executor_id]
        if handle.pending is not None and not handle.pending.done():
            handle.pending.cancel()
        if handle.task is not None and handle.task is not asyncio.current_task():
            handle.task.cancel()
        self.num_preemptions_retired += handle.scheduler.stats().num_preemptions
        requests = handle.scheduler.drain()
        for request in requests:
            self._location.pop(request.req_id, None)
        return requests

    async def _monitor(self) -> None:
        tick = 0.2
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if now - last > self.config.executor_timeout_s / 2:
                # Our own loop stalled: heartbeats may sit unread in the socket. Judge nobody on it.
                for handle in self.executors.values():
                    handle.last_seen = max(handle.last_seen, now - tick)
            last = now
            for handle in list(self.executors.values()):
                if now - handle.last_seen > self.config.executor_timeout_s:
                    self._kill(handle, f"no heartbeat for {now - handle.last_seen:.1f} s")
            expired = [r for d, r in self._orphans if d <= now]
            if expired:
                self._orphans = [(d, r) for d, r in self._orphans if d > now]
                for request in expired:
                    placement = self._placements.get(request.req_id)
                    state = placement.state if placement is not None else self._beam_states.get(request.req_id)
                    if state is not None and not state.done:
                        self._fail(
                            state,
                            Unavailable(
                                f"no executor could serve request {state.request_id} "
                                f"within {self.config.no_executor_wait_s:g} s"
                            ),
                        )

    def _fail(self, state: RequestState, error: Exception) -> None:
        self._drop_beams(state)
        for sample in state.samples:
            if not sample.finished:
                self._drop_core_request(sample.core_req_id, FinishReason.ABORTED)
        state.fail(error)
        self._close(state)


def _sample_sampling(params: GenerateParams, index: int):
    sampling = params.sampling
    if sampling.seed is None or index == 0:
        return sampling
    from dataclasses import replace

    return replace(sampling, seed=(sampling.seed + index) % _U64)
