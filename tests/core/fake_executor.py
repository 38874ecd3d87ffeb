"""A fake executor that keeps per-request state exactly as `pagoda.step` describes.

Its "KV cache" maps each slot to a fingerprint of the whole prefix ending at that
position (real KV at position p depends on tokens 0..p). Every step it writes the
scheduled positions of every request first, then "attends": it checks that every
slot of positions 0..end of each scheduled request holds that request's own
fingerprint. So a wrong prefix hit, a missing block copy, a block shared while being
written, or a block reused too early is caught where a real model would silently
produce different tokens. Sampled tokens are a deterministic function of the full
token sequence and the seed, or (`markov=True`) of the last token and the seed, whose
periodic text prompt lookup predicts well.

KV cache groups (`SchedulerConfig.kv_cache_groups`): each group has its own block
table and its own slots; a full-attention group attends to every position before the
query, a sliding-window group (window W) only to the last W, so only those must hold
the request's fingerprints (the blocks before may be the null block, which is never
read or written).

Draft tokens (speculative decoding) are written and attended like any position; the
fake model then accepts the longest prefix it agrees with plus its own next token,
and rolls its computed count back: the rejected positions' slots keep the drafts'
fingerprints, so a scheduler that counted them as computed, or cached their blocks,
is caught by the next attend.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagoda.step import KVCacheGroupSpec, SampledToken, SamplingParams, StepPlan, StepResult
from scheduler_svc.core import Request, RequestUpdate, Scheduler
from scheduler_svc.core.config import FULL_ATTENTION


def next_token(fingerprint: int, seed: int | None, vocab_size: int) -> int:
    return hash((fingerprint, seed or 0, 0x5EED)) % vocab_size


def predict(state: "FakeRequestState", vocab_size: int, markov: bool) -> int:
    """The fake model's token after `state.token_ids`."""
    context = state.token_ids[-1] if markov else state.fingerprint(len(state.token_ids) - 1)
    return next_token(context, state.seed, vocab_size)


@dataclass
class FakeRequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    seed: int | None
    block_ids: tuple[list[int], ...]  # one table per KV cache group
    num_computed_tokens: int
    fingerprints: list[int] = field(default_factory=list)

    def truncate(self, num_tokens: int) -> None:
        del self.token_ids[num_tokens:]
        del self.fingerprints[num_tokens:]

    def fingerprint(self, position: int) -> int:
        while len(self.fingerprints) <= position:
            parent = self.fingerprints[-1] if self.fingerprints else 17
            self.fingerprints.append(hash((parent, self.token_ids[len(self.fingerprints)])))
        return self.fingerprints[position]

    def fingerprint_with(self, position: int, drafts: list[int]) -> int:
        """The fingerprint of `position` with `drafts` appended; the state is left as it was."""
        num_tokens = len(self.token_ids)
        self.token_ids.extend(drafts)
        value = self.fingerprint(position)
        self.truncate(num_tokens)
        return value


class FakeExecutor:
    """Runs `StepPlan`s against a fingerprint KV cache; raises AssertionError on any misuse."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        vocab_size: int = 64,
        markov: bool = False,
        kv_cache_groups: tuple[KVCacheGroupSpec, ...] = FULL_ATTENTION,
    ) -> None:
        self.block_size = block_size
        self.windows = [group.sliding_window for group in kv_cache_groups]
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self.markov = markov
        self.num_drafts_accepted = 0
        self.num_drafts_rejected = 0
        self.states: dict[str, FakeRequestState] = {}
        self.slots: dict[int, int] = {}
        self.num_steps = 0
        self.num_block_copies = 0
        self.num_new_with_computed = 0  # prefix hits and forks
        self.num_windows_freed = 0  # views seen where the scheduler freed a block the executor still names

    def execute(self, plan: StepPlan) -> StepResult:
        self.num_steps += 1
        for req_id in plan.finished_req_ids:
            assert req_id in self.states, f"drop of unknown request {req_id}"
            del self.states[req_id]
        for copy in plan.block_copies:
            self._copy_block(copy.src, copy.dst)
        self.num_block_copies += len(plan.block_copies)
        self.num_new_with_computed += sum(1 for new in plan.new_requests if new.num_computed_tokens > 0)
        for new in plan.new_requests:
            assert new.req_id not in self.states, f"new request {new.req_id} already held"
            self.states[new.req_id] = FakeRequestState(
                list(new.token_ids),
                new.num_prompt_tokens,
                new.sampling.seed,
                tuple(list(ids) for ids in new.block_ids),
                new.num_computed_tokens,
            )
            assert len(new.block_ids) == len(self.windows), f"{new.req_id}: {len(new.block_ids)} tables"
        for cached in plan.cached_requests:
            assert cached.req_id in self.states, f"diff for unknown request {cached.req_id}"
            tables = self.states[cached.req_id].block_ids
            assert len(cached.new_block_ids) == len(tables), f"{cached.req_id}: {len(cached.new_block_ids)} tables"
            for table, new_ids in zip(tables, cached.new_block_ids):
                table.extend(new_ids)
        drafts = plan.scheduled_spec_decode_tokens
        for req_id, num_scheduled in plan.num_scheduled_tokens.items():
            self._write(req_id, num_scheduled, drafts.get(req_id, []))
        sampled = []
        for req_id, num_scheduled in plan.num_scheduled_tokens.items():
            sampled += self._attend_and_sample(req_id, num_scheduled, drafts.get(req_id, []))
        return StepResult(step_id=plan.step_id, sampled=sampled)

    def _slot(self, state: FakeRequestState, group: int, position: int) -> int:
        table = state.block_ids[group]
        index = position // self.block_size
        assert index < len(table), f"position {position} beyond the block table of group {group}"
        block_id = table[index]
        assert 0 < block_id < self.num_blocks, f"bad block id {block_id} for position {position} in group {group}"
        return block_id * self.block_size + position % self.block_size

    def _copy_block(self, src: int, dst: int) -> None:
        assert 0 < src < self.num_blocks and 0 < dst < self.num_blocks and src != dst
        for offset in range(self.block_size):
            value = self.slots.get(src * self.block_size + offset)
            if value is None:
                self.slots.pop(dst * self.block_size + offset, None)
            else:
                self.slots[dst * self.block_size + offset] = value

    def _write(self, req_id: str, num_scheduled: int, drafts: list[int]) -> None:
        state = self.states[req_id]
        start = state.num_computed_tokens
        assert num_scheduled >= 1 and start + num_scheduled <= len(state.token_ids) + len(drafts), (req_id, start, num_scheduled)
        if drafts:
            assert start + num_scheduled == len(state.token_ids) + len(drafts), f"{req_id}: drafts not at the end"
        for position in range(start, start + num_scheduled):
            fingerprint = state.fingerprint_with(position, drafts)
            for group in range(len(self.windows)):
                self.slots[self._slot(state, group, position)] = fingerprint

    def _attend_and_sample(self, req_id: str, num_scheduled: int, drafts: list[int]) -> list[SampledToken]:
        state = self.states[req_id]
        first_query = state.num_computed_tokens
        state.num_computed_tokens += num_scheduled
        num_tokens = len(state.token_ids)
        state.token_ids.extend(drafts)
        for group, window in enumerate(self.windows):
            first_read = 0 if window is None else max(first_query - window + 1, 0)
            for position in range(first_read, state.num_computed_tokens):
                slot = self._slot(state, group, position)
                assert self.slots.get(slot) == state.fingerprint(position), (
                    f"{req_id}: KV of position {position} (slot {slot}, group {group}) is not this request's"
                )
        if state.num_computed_tokens < len(state.token_ids):
            return []
        num_accepted = 0
        state.truncate(num_tokens)
        while True:  # the model's token after each accepted prefix
            token_id = predict(state, self.vocab_size, self.markov)
            state.token_ids.append(token_id)
            if num_accepted == len(drafts) or token_id != drafts[num_accepted]:
                break
            num_accepted += 1
        state.num_computed_tokens -= len(drafts) - num_accepted
        self.num_drafts_accepted += num_accepted
        self.num_drafts_rejected += len(drafts) - num_accepted
        return [SampledToken(req_id=req_id, token_id=t) for t in state.token_ids[num_tokens:]]


def step(scheduler: Scheduler, executor: FakeExecutor) -> list[RequestUpdate]:
    """One scheduler step through the fake executor, checking both views agree afterwards."""
    plan = scheduler.schedule()
    assert plan.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
    assert len(plan.num_scheduled_tokens) <= scheduler.config.max_num_seqs
    updates = scheduler.update_from_output(plan, executor.execute(plan))
    assert_views_agree(scheduler, executor)
    return updates


def assert_views_agree(scheduler: Scheduler, executor: FakeExecutor) -> None:
    """Both views of every running request agree; with steps in flight (async scheduling) the
    executor is ahead by exactly their tokens, the scheduler's placeholders."""
    scheduler.check_integrity()
    running = {request.req_id: request for request in scheduler.running}
    assert set(executor.states) == set(running) | set(scheduler.pending_finished_req_ids)
    manager = scheduler.kv_cache_manager
    for req_id, request in running.items():
        state = executor.states[req_id]
        assert state.token_ids[: request.num_tokens] == request.all_token_ids, req_id
        assert len(state.token_ids) == request.num_tokens + request.num_output_placeholders, req_id
        assert state.num_computed_tokens == request.num_computed_tokens, req_id
        # a block the scheduler freed outside a sliding window is not announced: the executor's
        # entry keeps its old id (never read), where the scheduler's is the null block
        tables = manager.block_ids(req_id)
        assert [len(t) for t in state.block_ids] == [len(t) for t in tables], req_id
        for held, planned, window in zip(state.block_ids, tables, executor.windows):
            assert all(p in (0, h) for h, p in zip(held, planned)), (req_id, held, planned)
            executor.num_windows_freed += any(p == 0 and h != 0 for h, p in zip(held, planned))
            # the scheduler still holds every block the next query reads (its freed ones may be reused)
            first_read = 0 if window is None else max(request.num_computed_tokens - window + 1, 0)
            assert 0 not in planned[first_read // executor.block_size :], (req_id, window, request.num_computed_tokens, planned)


def run_to_completion(
    scheduler: Scheduler, executor: FakeExecutor, max_steps: int = 10_000
) -> dict[str, list[RequestUpdate]]:
    """Step until nothing is left; the updates of each request, in order."""
    updates: dict[str, list[RequestUpdate]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return updates
        for update in step(scheduler, executor):
            updates.setdefault(update.req_id, []).append(update)
    raise AssertionError(f"not done after {max_steps} steps")


def make_request(
    req_id: str,
    prompt: list[int],
    max_tokens: int = 4,
    *,
    priority: int = 0,
    arrival_time: float = 0.0,
    seed: int | None = None,
    **sampling_kwargs: object,
) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        sampling=SamplingParams(seed=seed, **sampling_kwargs),  # type: ignore[arg-type]
        max_tokens=max_tokens,
        priority=priority,
        arrival_time=arrival_time,
    )


def reference_output(request: Request, max_seq_len: int, vocab_size: int = 64, markov: bool = False) -> list[int]:
    """The tokens `request` must end with if it runs to a natural stop, computed directly."""
    state = FakeRequestState(list(request.prompt_token_ids), request.num_prompt_tokens, request.sampling.seed, ([],), 0)
    output: list[int] = []
    while True:
        token_id = predict(state, vocab_size, markov)
        state.token_ids.append(token_id)
        output.append(token_id)
        if token_id in request.stop_token_ids and len(output) >= request.sampling.min_tokens:
            return output
        if len(output) >= request.max_tokens or len(state.token_ids) >= max_seq_len:
            return output


class AheadDriver:
    """Drives a scheduler with one step planned ahead of the last result, as the engine
    does with async scheduling: the executor runs each plan as it arrives, in order, and
    the scheduler applies a result only after planning the next step."""

    def __init__(self, scheduler: Scheduler, executor: FakeExecutor) -> None:
        self.scheduler, self.executor = scheduler, executor
        self.in_flight: deque[tuple[StepPlan, StepResult]] = deque()

    def step(self) -> list[RequestUpdate]:
        plan = self.scheduler.schedule()
        assert plan.total_num_scheduled_tokens <= self.scheduler.config.max_num_batched_tokens
        assert len(plan.num_scheduled_tokens) <= self.scheduler.config.max_num_seqs
        self.in_flight.append((plan, self.executor.execute(plan)))
        updates = self.apply_oldest() if len(self.in_flight) > 1 else []
        assert_views_agree(self.scheduler, self.executor)
        return updates

    def apply_oldest(self) -> list[RequestUpdate]:
        plan, result = self.in_flight.popleft()
        return self.scheduler.update_from_output(plan, result)

    def run_to_completion(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                while self.in_flight:
                    self.apply_oldest()
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")
