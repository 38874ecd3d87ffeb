"""A tiny scheduler for executor tests: hand-built `StepPlan`s without the real scheduler.

Each request is admitted at a chosen step, prefilled in chunks of the sizes given (cycled),
then decoded one token per step until `max_tokens` tokens are generated. Blocks come
from a shuffled free list, so block tables are never contiguous.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pagoda.step import CachedRequestData, NewRequestData, SamplingParams, StepPlan, StepResult

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class _Request:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    max_tokens: int
    chunk_sizes: list[int]
    start_step: int
    images: tuple = ()
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    sent: bool = False
    num_chunks: int = 0

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class PlanBuilder:
    def __init__(self, block_size: int = 16, num_blocks: int = 512, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.requests: dict[str, _Request] = {}
        self.finished: list[str] = []
        self.outputs: dict[str, list[int]] = {}
        self.step_id = 0

    def add(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int,
        sampling: SamplingParams = GREEDY,
        chunk_sizes: list[int] | None = None,
        start_step: int = 0,
        images: tuple = (),
    ) -> None:
        self.requests[req_id] = _Request(
            req_id, list(prompt), len(prompt), sampling, max_tokens, chunk_sizes or [len(prompt)], start_step, tuple(images)
        )
        self.outputs[req_id] = []

    def done(self) -> bool:
        return not self.requests

    def next_plan(self) -> StepPlan:
        plan = StepPlan(step_id=self.step_id, finished_req_ids=self.finished)
        self.finished = []
        for r in self.requests.values():
            if r.start_step > self.step_id:
                continue
            remaining = len(r.token_ids) - r.num_computed_tokens
            if r.num_computed_tokens < r.num_prompt_tokens:
                n = min(r.chunk_sizes[r.num_chunks % len(r.chunk_sizes)], remaining)
                r.num_chunks += 1
            else:
                n = remaining
            new_blocks = self._allocate(r, r.num_computed_tokens + n)
            if not r.sent:
                r.sent = True
                plan.new_requests.append(
                    NewRequestData(
                        r.req_id,
                        list(r.token_ids),
                        r.num_prompt_tokens,
                        r.sampling,
                        list(r.block_ids),
                        r.num_computed_tokens,
                        images=r.images,
                    )
                )
            elif new_blocks:
                plan.cached_requests.append(CachedRequestData(r.req_id, new_blocks))
            plan.num_scheduled_tokens[r.req_id] = n
        self.step_id += 1
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> None:
        for req_id, n in plan.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        for token in result.sampled:
            r = self.requests[token.req_id]
            r.token_ids.append(token.token_id)
            self.outputs[r.req_id].append(token.token_id)
            if r.num_generated >= r.max_tokens:
                self._finish(r.req_id)

    def preempt(self, req_id: str) -> None:
        """Drop the executor's state; the request comes back as new, with every token so far."""
        r = self.requests[req_id]
        self.finished.append(req_id)
        self.free.extend(reversed(r.block_ids))
        r.block_ids, r.num_computed_tokens, r.sent, r.num_chunks = [], 0, False, 0

    def _finish(self, req_id: str) -> None:
        r = self.requests.pop(req_id)
        self.free.extend(reversed(r.block_ids))
        self.finished.append(req_id)

    def _allocate(self, r: _Request, num_tokens: int) -> list[int]:
        needed = -(-num_tokens // self.block_size) - len(r.block_ids)
        new = [self.free.pop() for _ in range(max(needed, 0))]
        r.block_ids.extend(new)
        return new


def run_to_completion(runner, builder: PlanBuilder, max_steps: int = 10_000, on_step=None) -> dict[str, list[int]]:
    """Drive `runner` with `builder`'s plans until every request is done; returns the generated tokens."""
    for _ in range(max_steps):
        if builder.done():
            break
        plan = builder.next_plan()
        if on_step is not None:
            result = on_step(plan)
        else:
            result = runner.execute(plan)
        builder.update(plan, result)
    runner.execute(StepPlan(step_id=builder.step_id, finished_req_ids=builder.finished))
    builder.finished = []
    return builder.outputs


def record_sampled_rows(runner) -> list[str]:
    """Wrap `runner.prepare_inputs` (as an instance attribute) so that the returned list holds,
    once each step's inputs are built, the request id of each row of that step's logits."""
    rows: list[str] = []
    prepare = runner.prepare_inputs

    def remember(plan):
        inputs = prepare(plan)
        rows[:] = inputs.sampled_req_ids
        return inputs

    runner.prepare_inputs = remember
    return rows


def run_with_scheduler(runner, scheduler, max_steps: int = 10_000) -> int:
    """Drive `runner` with the real core `scheduler` (plans and results through the wire
    protobufs) until it holds no request, its drops included; returns the number of steps."""
    from pagoda import wire
    from pagoda.v1 import executor_pb2 as pb

    for num_steps in range(max_steps):
        plan = scheduler.schedule()
        sent = wire.plan_from_proto(pb.StepPlan.FromString(wire.plan_to_proto(plan).SerializeToString()))
        result = runner.execute(sent)
        scheduler.update_from_output(plan, wire.result_from_proto(pb.StepResult.FromString(wire.result_to_proto(result).SerializeToString())))
        scheduler.check_integrity()
        if not scheduler.has_unfinished() and not scheduler.pending_finished_req_ids:
            return num_steps + 1
    raise AssertionError(f"not done after {max_steps} steps")


def run_beam_searches(runner, scheduler, searches, on_step=None, max_steps: int = 500) -> None:
    """Drive `runner` with the core `scheduler` until the beam `searches` (scheduler_svc.beam_search.BeamSearch,
    their roots added) are done: each sampled token to its search, each generation's forks applied;
    `on_step()` after every step. The finished beams' state is dropped from the runner at the end."""
    from scheduler_svc.beam_search import apply_beam_step

    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            break
        plan = scheduler.schedule()
        for update in scheduler.update_from_output(plan, runner.execute(plan)):
            for search in searches:
                if update.sampled is not None and update.req_id in search.live_req_ids:
                    beam_step = search.on_sampled(update.sampled)
                    if beam_step is not None:
                        apply_beam_step(scheduler, beam_step)
        if on_step is not None:
            on_step()
    runner.execute(scheduler.schedule())
    assert all(search.done for search in searches) and not runner.requests
