"""Prefix-cache events: every block that enters or leaves an executor's cache is told, in order."""

import dataclasses

from scheduler_svc.core import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheManager, Scheduler, SchedulerConfig
from scheduler_svc.core.block_hash import block_hashes_of

from .fake_executor import FakeExecutor, make_request, run_to_completion
from .test_prefix_cache import admit, compute


def test_a_prompt_is_stored_as_one_chain_whose_first_block_has_no_parent():
    manager = KVCacheManager(block_size=4, num_blocks=10, enable_prefix_caching=True, enable_kv_cache_events=True)
    request = make_request("a", list(range(10)))
    admit(manager, request)
    compute(manager, request, 6)  # a first chunk, positions 0..5: block 0 is full
    compute(manager, request, 4)  # the rest: block 1 is full, block 2 partial (never cached)
    keys = block_hashes_of(list(range(10)), 4)
    assert manager.block_pool.take_events() == [
        BlockStored((keys[0],), None, ""),
        BlockStored((keys[1],), keys[0].hash_value, ""),
    ]
    assert [k.token_ids for k in keys] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert manager.block_pool.take_events() == []  # drained


def test_a_shared_prefix_is_stored_once_and_the_continuation_names_it_as_parent():
    manager = KVCacheManager(block_size=2, num_blocks=20, enable_prefix_caching=True, enable_kv_cache_events=True)
    first = make_request("a", [1, 2, 3, 4, 5])
    admit(manager, first)
    compute(manager, first, 5)
    manager.block_pool.take_events()
    second = make_request("b", [1, 2, 3, 4, 9, 9, 7])
    assert admit(manager, second) == 4
    compute(manager, second, 3)
    keys = block_hashes_of([1, 2, 3, 4, 9, 9, 7], 2)
    assert manager.block_pool.take_events() == [BlockStored((keys[2],), keys[1].hash_value, "")]


def test_salted_blocks_carry_their_salt():
    manager = KVCacheManager(block_size=2, num_blocks=10, enable_prefix_caching=True, enable_kv_cache_events=True)
    request = dataclasses.replace(make_request("a", [1, 2, 3]), cache_salt="3:bob|")
    admit(manager, request)
    compute(manager, request, 3)
    (event,) = manager.block_pool.take_events()
    assert event.cache_salt == "3:bob|"
    assert event.block_hashes == (block_hashes_of([1, 2, 3], 2, "3:bob|")[0].hash_value,)


def test_a_block_whose_key_is_cached_elsewhere_splits_the_stored_run():
    manager = KVCacheManager(block_size=2, num_blocks=20, enable_prefix_caching=True, enable_kv_cache_events=True)
    both = [1, 2, 3, 4]
    a, b = make_request("a", both + [5, 6, 7]), make_request("b", both + [8, 9, 7])
    admit(manager, a)
    admit(manager, b)  # admitted together: neither hit the other
    compute(manager, a, 4)
    manager.block_pool.take_events()
    compute(manager, b, 7)  # b's first two blocks are already a's: only its third is new
    keys = block_hashes_of(both + [8, 9, 7], 2)
    assert manager.block_pool.take_events() == [BlockStored((keys[2],), keys[1].hash_value, "")]


def test_eviction_is_told_and_reset_clears_only_when_no_block_is_in_use():
    manager = KVCacheManager(block_size=2, num_blocks=4, enable_prefix_caching=True, enable_kv_cache_events=True)
    a = make_request("a", [1, 2, 3])
    admit(manager, a)
    compute(manager, a, 3)
    (stored,) = manager.block_pool.take_events()
    assert not manager.block_pool.reset_prefix_cache()  # a holds its blocks
    manager.remove(a)
    b = make_request("b", [7, 8, 9, 10, 11])  # needs all 3 blocks: evicts a's cached one
    admit(manager, b)
    assert manager.block_pool.take_events() == [BlockRemoved(stored.block_hashes)]
    manager.remove(b)
    assert manager.block_pool.reset_prefix_cache()
    assert manager.block_pool.take_events() == [AllBlocksCleared()]
    assert manager.block_pool.num_cached_blocks == 0
    assert manager.num_prefix_cached_tokens([1, 2, 3]) == 0
    manager.check_integrity()


def test_events_are_off_by_default():
    manager = KVCacheManager(block_size=2, num_blocks=10, enable_prefix_caching=True)
    request = make_request("a", [1, 2, 3])
    admit(manager, request)
    compute(manager, request, 3)
    assert manager.block_pool.take_events() == []


def test_the_scheduler_reports_what_its_steps_cached_and_resets_only_when_idle():
    config = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64, enable_kv_cache_events=True)
    scheduler = Scheduler(config)
    executor = FakeExecutor(block_size=4, num_blocks=32)
    prompt = list(range(1, 11))
    scheduler.add_requests([make_request("a", prompt, max_tokens=3)])
    scheduler.schedule()
    assert not scheduler.reset_prefix_cache()  # a request is here (and a step is planned)
    scheduler = Scheduler(config)  # a fresh one: the fake executor never ran that plan
    scheduler.add_requests([make_request("a", prompt, max_tokens=3)])
    run_to_completion(scheduler, executor)
    events = scheduler.take_kv_events()
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    # prompt (10) + 3 outputs, the last never computed: 12 computed tokens = 3 full blocks
    assert len(stored) == 3
    assert stored[:2] == [h.hash_value for h in block_hashes_of(prompt, 4)]
    assert scheduler.reset_prefix_cache()
    assert scheduler.take_kv_events() == [AllBlocksCleared()]


def test_events_follow_the_first_kv_cache_group_only():
    """With several groups each caches its own copy of a prefix; a router hears of one."""
    from pagoda.step import KVCacheGroupSpec

    groups = (KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,), 4))
    manager = KVCacheManager(2, 20, True, True, kv_cache_groups=groups)
    request = make_request("a", [1, 2, 3, 4, 5])
    assert manager.allocate_slots(request, 5) is not None
    request.num_computed_tokens = 5
    manager.cache_full_blocks(request)
    assert manager.block_pool.num_cached_blocks == 4  # two full blocks in each group
    (stored,) = manager.block_pool.take_events()
    assert len(stored.block_hashes) == 2
