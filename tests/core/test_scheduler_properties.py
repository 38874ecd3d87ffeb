"""Property tests: the scheduler driven by a fake executor through random histories.

After every rule: free + in use == total, every ref count equals its holders, and the
executor's view (tokens, block tables, computed counts) equals the scheduler's. Every
request that stops on its own ends with exactly the tokens a direct computation gives,
whatever preemption, prefix hits, forks or moves between executors happened on the way.
"""

import dataclasses

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagoda.step import KVCacheGroupSpec, SamplingParams
from scheduler_svc.core import FinishReason, Request, Scheduler, SchedulerConfig, SpeculativeConfig

from .fake_executor import FakeExecutor, assert_views_agree, reference_output, run_to_completion, step

VOCAB_SIZE = 64
PREFIXES = ([], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [7, 7, 7, 7, 7, 7, 7, 7])

configs = st.builds(
    SchedulerConfig,
    num_blocks=st.integers(3, 16),
    block_size=st.sampled_from([1, 2, 3, 4]),
    max_num_batched_tokens=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
    max_model_len=st.integers(4, 40),
    enable_prefix_caching=st.booleans(),
)

# KV cache groups: one to three, each full attention (None) or a sliding window of 1..12 tokens (short ones often)
kv_cache_groups = st.lists(st.one_of(st.none(), st.integers(1, 6), st.integers(1, 12)), min_size=1, max_size=3).map(
    lambda windows: tuple(KVCacheGroupSpec((i,), window) for i, window in enumerate(windows))
)

speculative_configs = st.builds(
    SpeculativeConfig,
    num_speculative_tokens=st.integers(1, 5),
    prompt_lookup_min=st.integers(1, 2),
    prompt_lookup_max=st.integers(2, 4),
)


@st.composite
def request_groups(draw: st.DrawFn, first_id: int) -> list[Request]:
    """One request, or n siblings: same prompt, own ids and seeds."""
    prompt = draw(st.sampled_from(PREFIXES)) + draw(st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=8))
    if not prompt:
        prompt = [draw(st.integers(0, VOCAB_SIZE - 1))]
    n = draw(st.integers(1, 3))
    stop_token_ids = tuple(draw(st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3, unique=True)))
    eos_token_ids = frozenset(stop_token_ids[:1])
    min_tokens = draw(st.integers(0, 2))
    max_tokens = draw(st.integers(1, 12))
    priority = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 1000))
    return [
        Request(
            req_id=f"r{first_id + i}",
            prompt_token_ids=list(prompt),
            sampling=SamplingParams(seed=seed + i, stop_token_ids=stop_token_ids, min_tokens=min_tokens),
            max_tokens=max_tokens,
            eos_token_ids=eos_token_ids,
            priority=priority,
            arrival_time=float(first_id),
        )
        for i in range(n)
    ]


def check_outputs(requests: list[Request], max_seq_len: int, markov: bool = False, vocab_size: int = VOCAB_SIZE) -> None:
    for request in requests:
        assert request.is_finished, request.req_id
        expected = reference_output(request, max_seq_len, vocab_size, markov)
        if request.finish_reason in (FinishReason.ABORTED, FinishReason.STOP_SEQUENCE):
            assert request.output_token_ids == expected[: request.num_output_tokens], request.req_id
        else:
            assert request.output_token_ids == expected, request.req_id


class SchedulerMachine(RuleBasedStateMachine):
    """add / step / finish / abort / drain-and-move, checked after every rule.

    `speculative`: every history also drafts tokens (prompt lookup), against a fake
    model with a small vocabulary that is sometimes predictable (`markov`), so drafts
    are accepted and rejected. `hybrid`: the executor has several KV cache groups, full
    attention and sliding windows (`kv_cache_groups`).
    """

    speculative = False
    hybrid = False
    vocab_size = VOCAB_SIZE

    @initialize(config=configs, data=st.data())
    def start(self, config: SchedulerConfig, data: st.DataObject) -> None:
        self.markov = False
        if self.speculative:
            config = dataclasses.replace(config, speculative=data.draw(speculative_configs, label="speculative"))
            self.markov = data.draw(st.booleans(), label="markov")
        if self.hybrid:  # (sequences longer than the windows, so that they slide)
            groups, max_model_len = data.draw(kv_cache_groups, label="groups"), data.draw(st.integers(12, 48))
            config = dataclasses.replace(config, kv_cache_groups=groups, max_model_len=max_model_len)
        self.config = config
        self.scheduler = Scheduler(config)
        self.executor = self._new_executor()
        self.requests: list[Request] = []
        self.num_moves = 0
        self.num_preemptions = 0
        self.num_block_copies = 0
        self.num_new_with_computed = 0
        for _ in range(data.draw(st.integers(0, 5), label="initial groups")):
            self.add(data)

    @rule(data=st.data())
    def add(self, data: st.DataObject) -> None:
        group = data.draw(request_groups(len(self.requests)))
        if not self.scheduler.can_fit(group[0].num_tokens + 1):
            try:
                self.scheduler.add_requests(group)
            except ValueError:
                return
            raise AssertionError("a request that can never fit was accepted")
        self.scheduler.add_requests(group)
        self.requests.extend(group)

    def _new_executor(self) -> FakeExecutor:
        return FakeExecutor(
            self.config.block_size, self.config.num_blocks, self.vocab_size, self.markov, self.config.kv_cache_groups
        )

    @rule(num_steps=st.integers(1, 4))
    def run_steps(self, num_steps: int) -> None:
        for _ in range(num_steps):
            by_request: dict[str, list] = {}
            for update in step(self.scheduler, self.executor):
                by_request.setdefault(update.req_id, []).append(update)
            for req_id, updates in by_request.items():  # several with accepted drafts
                request = next(r for r in self.requests if r.req_id == req_id)
                assert request.output_token_ids[-len(updates) :] == [u.sampled.token_id for u in updates]
                assert all(u.finish_reason is None for u in updates[:-1])
                assert (updates[-1].finish_reason is not None) == request.is_finished

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), reason=st.sampled_from([FinishReason.ABORTED, FinishReason.STOP_SEQUENCE]))
    def finish(self, data: st.DataObject, reason: FinishReason) -> None:
        request = data.draw(st.sampled_from(self.requests))
        was_finished = request.is_finished
        finished = self.scheduler.finish_requests([request.req_id, "no-such-id"], reason)
        assert finished == ([] if was_finished else [request])
        assert self.scheduler.finish_requests(request.req_id, reason) == []

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort_while_a_step_runs(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.requests))
        plan = self.scheduler.schedule()
        result = self.executor.execute(plan)
        self.scheduler.finish_requests([request.req_id], FinishReason.ABORTED)
        updates = self.scheduler.update_from_output(plan, result)
        assert request.req_id not in {update.req_id for update in updates}

    @rule(when=st.sampled_from(["alive", "alive", "alive", "between steps", "mid-step"]))
    def drain_and_move(self, when: str) -> None:
        """The executor dies: its requests resume on a fresh executor and scheduler."""
        if when == "alive":
            return
        if when == "mid-step":
            self.executor.execute(self.scheduler.schedule())  # its result never arrives
        self._count_events()
        drained = self.scheduler.drain()
        assert not self.scheduler.has_unfinished()
        self.scheduler.check_integrity()
        stats = self.scheduler.stats()
        assert stats.num_free_blocks == stats.num_total_blocks and stats.kv_slots_allocated == 0
        self.scheduler = Scheduler(self.config)
        self.executor = self._new_executor()
        for request in drained:
            self.scheduler.add_requests([request])
        self.num_moves += 1

    @invariant()
    def views_agree(self) -> None:
        if hasattr(self, "scheduler"):
            assert_views_agree(self.scheduler, self.executor)
            stats = self.scheduler.stats()
            assert stats.num_running <= self.config.max_num_seqs
            assert 0 <= stats.kv_tokens_held <= stats.kv_slots_allocated

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        run_to_completion(self.scheduler, self.executor, max_steps=5_000)
        stats = self.scheduler.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        check_outputs(self.requests, self.config.max_seq_len, self.markov, self.vocab_size)
        self._count_events()
        event(f"preempted: {self.num_preemptions > 0}")
        event(f"block copies: {self.num_block_copies > 0}")
        event(f"prefix hits or forks: {self.num_new_with_computed > 0}")
        event(f"moved: {self.num_moves > 0}")

    def _count_events(self) -> None:
        self.num_preemptions += self.scheduler.num_preemptions
        self.num_block_copies += self.executor.num_block_copies
        self.num_new_with_computed += self.executor.num_new_with_computed
        if self.speculative:
            event(f"drafts accepted: {self.executor.num_drafts_accepted > 0}")
            event(f"drafts rejected: {self.executor.num_drafts_rejected > 0}")


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSchedulerMachine.pytestmark = [pytest.mark.slow]  # hundreds of random programs: make test, not make test-fast


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    groups=st.lists(st.integers(0, 10_000).flatmap(request_groups), min_size=1, max_size=6),
    small_blocks=st.integers(3, 10),
    block_size=st.sampled_from([1, 2, 4]),
    caching=st.booleans(),
)
def test_outputs_do_not_depend_on_preemption(groups, small_blocks, block_size, caching):
    """The same workload on a roomy pool and on a tiny one (preempting) gives the same tokens."""
    roomy = SchedulerConfig(
        num_blocks=400,
        block_size=block_size,
        max_num_batched_tokens=16,
        max_model_len=small_blocks * block_size,
        enable_prefix_caching=caching,
    )
    tiny = dataclasses.replace(roomy, num_blocks=small_blocks + 1)
    assert tiny.max_seq_len == roomy.max_seq_len
    outputs = []
    for config in (roomy, tiny):
        scheduler = Scheduler(config)
        executor = FakeExecutor(block_size, config.num_blocks, VOCAB_SIZE)
        requests = []
        for index, group in enumerate(groups):
            group = [dataclasses.replace(r, req_id=f"g{index}-{i}", output_token_ids=[]) for i, r in enumerate(group)]
            if scheduler.can_fit(group[0].num_tokens + 1):
                scheduler.add_requests(group)
                requests.extend(group)
        run_to_completion(scheduler, executor)
        if config is roomy:
            assert scheduler.num_preemptions == 0
        else:
            event(f"tiny pool preempted: {scheduler.num_preemptions > 0}")
        outputs.append({r.req_id: (r.output_token_ids, r.finish_reason) for r in requests})
        check_outputs(requests, config.max_seq_len)
    assert outputs[0] == outputs[1]
