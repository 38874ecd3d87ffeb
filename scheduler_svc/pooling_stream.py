"""The front end of one pooling client request (Embed, Rerank): its inputs, their owners, its answer.

A client request of k inputs is k core requests (`PoolingRequest`), each its own turn in the
engine's fair queue, so a large batch spreads over every executor with room and another
tenant's request never waits behind all of it. Each input has a `PoolOwner` (the engine routes
its `PoolUpdate` to it, and gives it back when its executor is lost: it is queued again whole,
and the next executor computes the same values). The request is answered once every input has
its values (`PoolStream.result()`), or fails at its first error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from pagoda.step import PoolRequest, PoolTask
from scheduler_svc.core import PoolingRequest, PoolUpdate
from scheduler_svc.errors import ServiceError
from scheduler_svc.metrics import Metrics

log = logging.getLogger(__name__)


class Aborted(ServiceError):
    """The request was aborted (Abort, or its call was cancelled) before every input had its values."""

    code = grpc.StatusCode.CANCELLED


@dataclass(frozen=True)
class PoolInput:
    token_ids: list[int]
    token_type_ids: list[int] = field(default_factory=list)  # empty: all 0


@dataclass(frozen=True)
class PoolParams:
    """A validated pooling request: its inputs, tokenized, and what to compute for each."""

    request_id: str
    inputs: list[PoolInput]
    task: PoolTask
    normalize: bool = False
    dimensions: int = 0  # 0: the whole vector
    priority: int = 0
    lora: str = ""  # (the engine's bookkeeping reads it; no adapter runs with a pooling model)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(i.token_ids) for i in self.inputs)


@dataclass(eq=False)
class PoolStream:
    """One pooling client request. `key` = (tenant, request_id) names it to the engine."""

    params: PoolParams
    tenant: str = ""
    core_id: str = ""  # unique in the engine: its core request ids are `<i>:<core_id>`
    arrival: float = field(default_factory=time.monotonic)
    values: dict[int, list[float]] = field(default_factory=dict)  # input index -> its values
    done: bool = False
    _answer: asyncio.Future | None = None

    @property
    def request_id(self) -> str:
        return self.params.request_id

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.params.request_id)

    def _future(self) -> asyncio.Future:
        if self._answer is None:
            self._answer = asyncio.get_running_loop().create_future()
        return self._answer

    def on_values(self, index: int, values: list[float]) -> None:
        self.values[index] = values

    def finish_if_done(self) -> bool:
        if self.done or len(self.values) < len(self.params.inputs):
            return False
        self.done = True
        future = self._future()
        if not future.done():
            future.set_result([self.values[i] for i in range(len(self.params.inputs))])
        return True

    def fail(self, error: ServiceError) -> None:
        self.done = True
        future = self._future()
        if not future.done():
            future.set_exception(error)

    def abort(self) -> None:
        self.fail(Aborted(f"request {self.request_id!r} was aborted"))

    def log_finish(self, metrics: Metrics) -> None:
        """Log the answered request; its latency and tokens count as a finished request's (no finish reason)."""
        log.info("pooling request %r finished: %d inputs, %d tokens", self.request_id, len(self.params.inputs),
                 self.params.num_prompt_tokens)
        metrics.observe_finish(self.arrival, self.params.num_prompt_tokens, [])

    async def result(self) -> list[list[float]]:
        """Every input's values, in order; raises the request's ServiceError if it failed."""
        return await self._future()


@dataclass(eq=False)
class PoolOwner:
    """One input of a pooling client request: its core request, and where its values go."""

    stream: PoolStream
    index: int
    request: PoolingRequest
    finished: bool = False

    @classmethod
    def for_inputs(cls, stream: PoolStream) -> list[PoolOwner]:
        params, now = stream.params, time.monotonic()
        return [
            cls(stream, index, PoolingRequest(
                PoolRequest(
                    req_id=f"{index}:{stream.core_id}", token_ids=list(item.token_ids), task=params.task,
                    token_type_ids=list(item.token_type_ids), normalize=params.normalize, dimensions=params.dimensions,
                ),
                priority=params.priority,
                arrival_time=now,
            ))
            for index, item in enumerate(params.inputs)
        ]

    @property
    def live_req_ids(self) -> list[str]:
        return [] if self.finished else [self.request.req_id]

    @property
    def done(self) -> bool:
        """This input has its values (or was aborted); the engine then closes the stream if every input has."""
        return self.finished

    def on_update(self, scheduler, update: PoolUpdate, owners) -> None:
        self.finished = True
        owners.release([update.req_id])
        self.stream.on_values(self.index, list(update.values))

    def on_executor_lost(self, request: PoolingRequest, owners) -> list[PoolingRequest]:
        return [request]

    def abort(self, reason: int, owners) -> None:
        owners.release(self.live_req_ids)
        self.finished = True
        if not self.stream.done:
            self.stream.abort()
