"""The scheduler of one pooling executor (--runner pooling): whole inputs under a token budget, no KV.

A pooling request (an input to embed, or a (query, document) pair to score) runs whole in one
step and is forgotten after it: encoders attend both ways, so an input is never chunked, and
nothing of it stays on the executor. So there is no block, no preemption and no prefix cache;
the rest is the generation scheduler's rule::

    budget = max_num_batched_tokens (at least max_model_len: any input fits one step)
    waiting, by (priority, arrival): admit whole inputs while their tokens fit the budget and
    the step holds fewer than max_num_seqs; the first that does not fit stops admission
    (no overtaking)

Request states::

    add_requests -> WAITING --schedule--> RUNNING (its step in flight) --result--> FINISHED
                       ^                                 |
                       +--------- drain (executor lost) -+      abort: FINISHED at once

With async scheduling a step may be planned while earlier ones run: a running request is in
exactly one step in flight, and `update_from_output` applies results oldest first. The engine
binds requests here as it does generation's (`can_admit`, `take_movable`), so an input waits in
the engine's fair queue until an executor has room for it in its next step.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pagoda.step import PoolRequest, PoolTask, StepPlan, StepResult
from scheduler_svc.core.kv_events import KVCacheEvent
from scheduler_svc.core.outputs import SchedulerStats, SpecDecodeStats
from scheduler_svc.core.request import FinishReason, RequestStatus

# The most values one pooled output may carry (a vector or a cross-encoder's labels): the
# largest embedding models' hidden sizes are 4096-8192.
MAX_POOLED_VALUES = 65_536


@dataclass(eq=False)
class PoolingRequest:
    """One input of a pooling client request; `pool` is what the executor gets (its `req_id` is this one's)."""

    pool: PoolRequest
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    prefix_salt: str = ""  # (routing reads it; a pooling request shares nothing)

    def __post_init__(self) -> None:
        if not self.pool.token_ids:
            raise ValueError(f"request {self.pool.req_id!r}: token_ids is empty")
        if self.pool.token_type_ids and len(self.pool.token_type_ids) != len(self.pool.token_ids):
            raise ValueError(f"request {self.pool.req_id!r}: token_type_ids and token_ids differ in length")

    @property
    def req_id(self) -> str:
        return self.pool.req_id

    @property
    def num_tokens(self) -> int:
        return len(self.pool.token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.pool.token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


class PoolUpdate(NamedTuple):
    """One request's news from a step: its values (a vector, or one score a label)."""

    req_id: str
    values: list[float]


@dataclass(frozen=True)
class PoolingSchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 512

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PoolingSchedulerConfig.{name} must be an int >= 1, got {value!r}")

    @property
    def step_budget(self) -> int:
        """Tokens a step may hold: never less than one input of max_model_len tokens."""
        return max(self.max_num_batched_tokens, self.max_model_len)


class PoolingScheduler:
    """Admission and token budget for one pooling executor; the generation `Scheduler`'s interface
    as the engine and the executor pool use it. Not thread-safe; `check_integrity()` holds between steps."""

    def __init__(self, config: PoolingSchedulerConfig) -> None:
        self.config = config
        self.num_preemptions = 0  # (never: nothing to preempt for)
        self._requests: dict[str, PoolingRequest] = {}
        self._order: dict[str, tuple[int, float, int]] = {}
        self._waiting: list[PoolingRequest] = []  # sorted by _key
        self._running: dict[str, PoolingRequest] = {}  # in a step in flight
        self._in_flight: deque[tuple[StepPlan, dict[str, PoolingRequest]]] = deque()  # oldest first
        self._next_seq = 0
        self._next_step_id = 0

    # ---- front end ------------------------------------------------------------------------

    def can_fit(self, num_tokens: int) -> bool:
        """Whether an input of `num_tokens - 1` tokens runs here: the engine asks as it does for a
        prompt, with room for one more token (an input of max_model_len tokens fits)."""
        return 0 < num_tokens <= self.config.max_model_len + 1

    @property
    def max_seq_len(self) -> int:
        return self.config.max_model_len + 1

    def num_prefix_cached_tokens(self, request: PoolingRequest) -> int:
        return 0

    def can_admit(self, requests: Sequence[PoolingRequest], num_cached_tokens: int = 0) -> bool:
        """Whether the next step would take `requests` besides those already waiting here: room
        under max_num_seqs, and their tokens within the step's budget (an input always fits an
        empty step). Late binding keeps the rest in the engine's queue for whichever executor is free."""
        if not requests:
            return False
        if len(self._running) + len(self._waiting) + len(requests) > self.config.max_num_seqs:
            return False
        waiting = sum(r.num_tokens for r in self._waiting)
        return not self._waiting or waiting + sum(r.num_tokens for r in requests) <= self.config.step_budget

    def set_waiting_elsewhere(self, heads) -> None:
        """The engine's fair-share hint (`Scheduler.set_waiting_elsewhere`): nothing to do here. A pooling
        input holds its slot for one step only, so no tenant can keep the others' inputs out; the
        engine's queue gives tenants their turns."""

    def holds_back(self, tenant: str) -> bool:
        """Never: see `set_waiting_elsewhere` (the generation Scheduler's rule is for requests that stay)."""
        return False

    def take_movable(self) -> list[PoolingRequest]:
        """Remove and return every waiting request (none holds anything here), for the engine's queue."""
        movable, self._waiting = self._waiting, []
        for request in movable:
            del self._requests[request.req_id]
            del self._order[request.req_id]
        return movable

    def add_requests(self, requests: Sequence[PoolingRequest]) -> None:
        """Queue requests; ValueError, adding nothing, for a duplicate id or one that can never run here."""
        req_ids = [request.req_id for request in requests]
        if not requests or len(set(req_ids)) != len(req_ids):
            raise ValueError(f"add_requests needs distinct requests, got {req_ids}")
        for request in requests:
            if request.req_id in self._requests or request.status is not RequestStatus.WAITING:
                raise ValueError(f"request {request.req_id!r} is already in flight or finished")
            if request.num_tokens > self.config.max_model_len:
                raise ValueError(f"request {request.req_id!r}: {request.num_tokens} tokens, more than max_model_len "
                                 f"{self.config.max_model_len}")
        for request in requests:
            self._requests[request.req_id] = request
            self._order[request.req_id] = (request.priority, request.arrival_time, self._next_seq)
            self._next_seq += 1
            bisect.insort(self._waiting, request, key=self._key)

    def finish_requests(self, req_ids: str | Iterable[str], reason: FinishReason) -> list[PoolingRequest]:
        """Finish requests now (abort); a running one's result is ignored when it comes. Unknown ids are ignored."""
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        finished = []
        for req_id in req_ids:
            request = self._requests.get(req_id)
            if request is not None:
                self._finish(request, reason)
                finished.append(request)
        return finished

    def drain(self) -> list[PoolingRequest]:
        """Remove every unfinished request, reset to run elsewhere (the executor is gone)."""
        requests = sorted(self._requests.values(), key=self._key)
        for request in requests:
            request.status = RequestStatus.WAITING
        self._requests.clear()
        self._order.clear()
        self._waiting.clear()
        self._running.clear()
        self._in_flight.clear()
        return requests

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get_request(self, req_id: str) -> PoolingRequest | None:
        return self._requests.get(req_id)

    def requested_top_logprobs(self, step_id: int, req_id: str) -> int | None:
        return None  # a pooling request gets no token

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._in_flight)

    def take_kv_events(self) -> list[KVCacheEvent]:
        return []

    def reset_prefix_cache(self) -> bool:
        return not self._requests and not self._in_flight

    def take_spec_decode_stats(self) -> SpecDecodeStats:
        return SpecDecodeStats()

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self._running), num_waiting=len(self._waiting), num_preemptions=0,
            num_total_blocks=0, num_free_blocks=0, num_cached_blocks=0, kv_slots_allocated=0, kv_tokens_held=0,
        )

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan the next step: whole waiting inputs, in order, while the budget and max_num_seqs allow."""
        plan = StepPlan(step_id=self._next_step_id)
        self._next_step_id += 1
        budget, scheduled = self.config.step_budget, {}
        for request in list(self._waiting):
            if len(scheduled) >= self.config.max_num_seqs or request.num_tokens > budget:
                break
            budget -= request.num_tokens
            self._waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self._running[request.req_id] = scheduled[request.req_id] = request
            plan.pool_requests.append(request.pool)
        if scheduled:
            self._in_flight.append((plan, scheduled))
        return plan

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[PoolUpdate]:
        """Apply the result of the oldest step in flight: each answered request finishes with its values.

        ValueError, changing nothing, for a result that does not answer the plan. A request in
        `result.errors` (failed alone) gets no update: its owner ends it. Requests aborted while
        the step ran are skipped.
        """
        self._check_result(plan, result)
        if not plan.pool_requests:
            return []
        _, scheduled = self._in_flight.popleft()
        updates = []
        failed = {error.req_id for error in result.errors}
        for output in result.pooled:
            request = self._requests.get(output.req_id)
            if request is not scheduled[output.req_id]:
                continue
            self._finish(request, FinishReason.LENGTH)
            updates.append(PoolUpdate(output.req_id, output.values))
        for req_id in failed:  # the engine ends them (Engine._fail_request_errors); nothing stays here
            request = self._requests.get(req_id)
            if request is scheduled[req_id]:
                self._finish(request, FinishReason.ABORTED)
        return updates

    def check_integrity(self) -> None:
        """Raise AssertionError unless queues, steps in flight and requests agree."""
        if {r.req_id for r in self._waiting} | set(self._running) != set(self._requests):
            raise AssertionError("running + waiting != known requests")
        if {r.req_id for r in self._waiting} & set(self._running):
            raise AssertionError("a request is both waiting and running")
        in_flight = [req_id for _, scheduled in self._in_flight for req_id in scheduled]
        if len(in_flight) != len(set(in_flight)):
            raise AssertionError("a request is in two steps in flight")
        for req_id, request in self._running.items():
            if request.status is not RequestStatus.RUNNING or req_id not in in_flight:
                raise AssertionError(f"running request {req_id!r} is in no step in flight")
        for request in self._waiting:
            if request.status is not RequestStatus.WAITING:
                raise AssertionError(f"waiting request {request.req_id!r} has status {request.status}")

    # ---- internals ------------------------------------------------------------------------

    def _finish(self, request: PoolingRequest, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            del self._running[request.req_id]
        else:
            self._waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._requests[request.req_id]
        del self._order[request.req_id]

    def _check_result(self, plan: StepPlan, result: StepResult) -> None:
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} for plan {plan.step_id}")
        if result.sampled:
            raise ValueError(f"step {plan.step_id}: sampled tokens from a pooling executor")
        if not plan.pool_requests:
            if result.pooled or result.errors:
                raise ValueError(f"step {plan.step_id} pooled nothing but has outputs")
            return
        if not self._in_flight or plan is not self._in_flight[0][0]:
            raise ValueError(f"plan {plan.step_id} is not the oldest step in flight")
        tasks = {r.req_id: r for r in plan.pool_requests}
        answered = [output.req_id for output in result.pooled] + [error.req_id for error in result.errors]
        if len(answered) != len(set(answered)) or set(answered) != set(tasks):
            raise ValueError(f"step {plan.step_id}: outputs and errors {sorted(answered)} do not answer "
                             f"each of {sorted(tasks)} once")
        for output in result.pooled:
            values, asked = output.values, tasks[output.req_id]
            if not 1 <= len(values) <= MAX_POOLED_VALUES or not all(map(math.isfinite, values)):
                raise ValueError(f"step {plan.step_id}: {len(values)} values for {output.req_id!r}, or not finite")
            if asked.task is PoolTask.EMBED and asked.dimensions and len(values) != asked.dimensions:
                raise ValueError(f"step {plan.step_id}: {len(values)} values for {output.req_id!r}, "
                                 f"which asked for {asked.dimensions} dimensions")

    def _key(self, request: PoolingRequest) -> tuple[int, float, int]:
        return self._order[request.req_id]
