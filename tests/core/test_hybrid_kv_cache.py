"""KV cache groups: one block table per group of layers, sliding-window blocks freed while a request runs.

Unit rules of `KVCacheManager` with full-attention and sliding-window groups (freeing,
prefix hits that need only the window, forks, fit), then the property machines of
`test_scheduler_properties` / `test_async_scheduling` / `test_spec_decode` over random
group layouts, checked against the fake executor, whose sliding-window groups read only
their window.
"""

import dataclasses

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant

from pagoda.step import KVCacheGroupSpec
from scheduler_svc.core import KVCacheManager, Scheduler, SchedulerConfig

from .fake_executor import FakeExecutor, make_request, run_to_completion
from .test_async_scheduling import AheadSchedulerMachine
from .test_scheduler_properties import VOCAB_SIZE, SchedulerMachine, check_outputs, kv_cache_groups, request_groups

FULL = KVCacheGroupSpec((0,))


def sliding(window: int, layer: int = 1) -> KVCacheGroupSpec:
    return KVCacheGroupSpec((layer,), window)


def compute(manager: KVCacheManager, request, num_tokens: int):
    """Allocate and 'compute' num_tokens more tokens of request, as a step would."""
    new_ids = manager.allocate_slots(request, num_tokens)
    assert new_ids is not None
    request.num_computed_tokens += num_tokens
    manager.cache_full_blocks(request)
    return new_ids


def test_sliding_window_blocks_are_freed_as_the_request_runs():
    """window 6, block_size 4: the query at position p reads p - 5 .. p, so block i is freed
    once the next query is past position 4 i + 3 + 5."""
    manager = KVCacheManager(4, 40, False, kv_cache_groups=(FULL, sliding(6)))
    request = make_request("a", list(range(9)))
    assert manager.allocate_slots(request, 9) == ([1, 2, 3], [4, 5, 6])
    request.num_computed_tokens = 9
    manager.check_integrity([request])
    for _ in range(30):  # decode to position 38
        request.append_output_token(0)
        compute(manager, request, 1)
        manager.check_integrity([request])
    full, window = manager.block_ids("a")
    num_skipped = (request.num_computed_tokens - 6 + 1) // 4
    assert window[:num_skipped] == [0] * num_skipped and 0 not in window[num_skipped:] and 0 not in full
    assert len(full) == len(window) == 10
    pool = manager.block_pool
    assert pool.num_total_blocks - pool.num_free_blocks == 10 + 10 - num_skipped
    manager.remove(request)
    assert pool.num_free_blocks == pool.num_total_blocks
    manager.check_integrity()


def test_a_sliding_window_request_holds_only_its_window():
    """A one-group sliding-window model (Mistral's): held blocks stay bounded however long it runs."""
    manager = KVCacheManager(4, 12, False, kv_cache_groups=(sliding(8, 0),))
    request = make_request("a", [1, 2, 3])
    compute(manager, request, 3)
    for _ in range(200):
        request.append_output_token(0)
        compute(manager, request, 1)
        held = manager.block_pool.num_total_blocks - manager.block_pool.num_free_blocks
        assert held <= 3  # positions p - 7 .. p touch at most 3 blocks of 4
    manager.check_integrity([request])


def test_sliding_window_hit_needs_only_the_window_before_it():
    """The early blocks of a sliding-window group are freed and then evicted, yet a second
    request with the same prompt hits all but its last block: the window is still cached."""
    manager = KVCacheManager(2, 12, True, kv_cache_groups=(sliding(3, 0),))
    prompt = list(range(20))
    first = make_request("a", prompt)
    for _ in range(10):
        compute(manager, first, 2)  # chunks of 2: early blocks leave the window and are freed
    manager.remove(first)
    assert manager.block_pool.num_cached_blocks == 10
    filler = make_request("f", [99] * 11)
    compute(manager, filler, 11)  # 6 blocks: evicts the 6 freed first, blocks of positions 0..11
    manager.remove(filler)
    second = make_request("b", prompt)
    blocks, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 18  # positions 16, 17 (the window of position 18) are cached
    assert [b.block_id for b in blocks[0][:8]] == [0] * 8 and 0 not in [b.block_id for b in blocks[0][8:]]
    assert manager.num_prefix_cached_tokens(prompt) == 18
    assert manager.allocate_slots(second, 2, blocks) is not None
    second.num_computed_tokens = 20
    manager.check_integrity([second])


def test_hybrid_hit_is_the_longest_prefix_every_group_accepts():
    """Full attention needs every block, the sliding window only its window: as the freed
    blocks are evicted tail first, the hit falls back to the longest point whose window and
    prefix are both still cached."""
    manager = KVCacheManager(2, 20, True, kv_cache_groups=(FULL, sliding(3)))
    prompt = list(range(12))
    first = make_request("a", prompt)
    compute(manager, first, 12)
    manager.remove(first)  # freed tail first: (block 5, window group), (5, full), (4, window), ...
    probe = prompt + [50]
    pool = manager.block_pool
    assert manager.num_prefix_cached_tokens(probe) == 12
    pool.get_new_blocks(pool.num_free_blocks - 12 + 1)  # the never-used blocks, then (5, window)
    blocks, num_hit = manager.get_computed_blocks(make_request("p", probe))
    assert num_hit == 10  # full attention hits 6 blocks; the window of position 10 is block 4
    assert [b.block_id for b in blocks[1]][:4] == [0] * 4 and 0 not in [b.block_id for b in blocks[1][4:]]
    assert len(blocks[0]) == len(blocks[1]) == 5 and 0 not in [b.block_id for b in blocks[0]]
    pool.get_new_blocks(2)  # (5, full) and (4, window)
    assert manager.get_computed_blocks(make_request("p", probe))[1] == 8
    assert manager.num_prefix_cached_tokens(probe) == 8


def test_leader_keeps_the_window_its_siblings_fork_from():
    """n = 3 with a sliding window shorter than the prompt: the followers fork from the leader
    once it has started decoding, whose window has moved past a block they read (positions
    9..11 for the last prompt token), and get the same tokens as three requests run alone."""
    groups = (sliding(3, 0), FULL)
    config = SchedulerConfig(
        num_blocks=64, block_size=2, max_num_batched_tokens=32, enable_prefix_caching=False, kv_cache_groups=groups
    )
    prompt = list(range(1, 13))

    def run(requests):
        scheduler = Scheduler(config)
        executor = FakeExecutor(2, 64, VOCAB_SIZE, kv_cache_groups=groups)
        scheduler.add_requests(requests)
        run_to_completion(scheduler, executor)
        return {r.req_id: r.output_token_ids for r in requests}, executor

    def siblings():
        return [make_request(f"s{i}", prompt, 8, seed=i) for i in range(3)]

    together, executor = run(siblings())
    assert executor.num_new_with_computed == 2  # both followers forked
    alone = {}
    for request in siblings():
        alone.update(run([request])[0])
    assert together == alone


def test_sliding_window_fits_far_longer_sequences():
    base = SchedulerConfig(num_blocks=65, block_size=16, max_num_batched_tokens=64, max_model_len=100_000)
    assert base.max_seq_len == 64 * 16
    windowed = dataclasses.replace(base, kv_cache_groups=(sliding(256, 0),))
    assert windowed.max_blocks_per_request(10**5) == -(-(256 + 64 - 2) // 16) + 1 == 21
    assert windowed.max_seq_len == 100_000
    hybrid = dataclasses.replace(base, kv_cache_groups=(FULL, sliding(256)))
    assert hybrid.max_seq_len == (64 - 21) * 16  # the full-attention group takes what the window leaves
    split = dataclasses.replace(base, kv_cache_groups=(FULL, KVCacheGroupSpec((1,))))
    assert split.max_seq_len == 32 * 16


def test_integrity_check_catches_a_window_freed_too_early():
    manager = KVCacheManager(2, 20, False, kv_cache_groups=(FULL, sliding(4)))
    request = make_request("a", list(range(10)))
    compute(manager, request, 10)
    request.append_output_token(0)
    compute(manager, request, 1)  # the next query (10) reads 7..10: blocks 0-2 freed
    assert manager.block_ids("a")[1][:4] == [0, 0, 0, manager.block_ids("a")[1][3]] != 0
    manager.check_integrity([request])
    request.num_computed_tokens = 4  # as if its next query read positions 1..4
    with pytest.raises(AssertionError, match="freed blocks its next query reads"):
        manager.check_integrity([request])


# ---- the property machines, over random KV cache group layouts ---------------------------

HYBRID_SETTINGS = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class WindowEvents:
    """Records whether a history freed a sliding-window block while its request ran."""

    hybrid = True

    @invariant()
    def note_freed_windows(self) -> None:
        if hasattr(self, "executor") and self.executor.num_windows_freed:
            self.freed_window = True

    def teardown(self) -> None:
        if hasattr(self, "scheduler"):
            self.note_freed_windows()
            event(f"window freed while running: {getattr(self, 'freed_window', False)}")
        super().teardown()


class HybridSchedulerMachine(WindowEvents, SchedulerMachine):
    pass


class HybridSpeculativeSchedulerMachine(WindowEvents, SchedulerMachine):
    speculative = True
    vocab_size = 8


class HybridAheadSchedulerMachine(WindowEvents, AheadSchedulerMachine):
    pass


TestHybridSchedulerMachine = HybridSchedulerMachine.TestCase
TestHybridSchedulerMachine.settings = HYBRID_SETTINGS
TestHybridSpeculativeSchedulerMachine = HybridSpeculativeSchedulerMachine.TestCase
TestHybridSpeculativeSchedulerMachine.settings = HYBRID_SETTINGS
TestHybridAheadSchedulerMachine = HybridAheadSchedulerMachine.TestCase
TestHybridAheadSchedulerMachine.settings = HYBRID_SETTINGS


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    groups=st.lists(st.integers(0, 10_000).flatmap(request_groups), min_size=1, max_size=6),
    layout=kv_cache_groups,
    small_blocks=st.integers(3, 12),
    block_size=st.sampled_from([1, 2, 4]),
    caching=st.booleans(),
)
def test_outputs_do_not_depend_on_groups_or_preemption(groups, layout, small_blocks, block_size, caching):
    """The same workload with one full-attention group on a roomy pool, and with the drawn groups
    on a tiny pool (preempting, windows freed): the same tokens."""
    roomy = SchedulerConfig(
        num_blocks=400,
        block_size=block_size,
        max_num_batched_tokens=16,
        max_model_len=small_blocks * block_size,
        enable_prefix_caching=caching,
    )
    tiny = dataclasses.replace(roomy, num_blocks=small_blocks * len(layout) + 1, kv_cache_groups=layout)
    assert tiny.max_seq_len == roomy.max_seq_len
    outputs = []
    for config in (roomy, tiny):
        scheduler = Scheduler(config)
        executor = FakeExecutor(block_size, config.num_blocks, VOCAB_SIZE, kv_cache_groups=config.kv_cache_groups)
        requests = []
        for index, group in enumerate(groups):
            group = [dataclasses.replace(r, req_id=f"g{index}-{i}", output_token_ids=[]) for i, r in enumerate(group)]
            if scheduler.can_fit(group[0].num_tokens + 1):
                scheduler.add_requests(group)
                requests.extend(group)
        run_to_completion(scheduler, executor)
        if config is tiny:
            event(f"tiny pool preempted: {scheduler.num_preemptions > 0}")
        outputs.append({r.req_id: (r.output_token_ids, r.finish_reason) for r in requests})
        check_outputs(requests, config.max_seq_len)
    assert outputs[0] == outputs[1]
