"""KVCacheManager: on-demand allocation, prefix hits, caching of computed blocks, LRU eviction."""

import dataclasses

import pytest

from scheduler_svc.core import KVCacheManager, Scheduler, SchedulerConfig, block_hash, kv_cache_manager
from scheduler_svc.core.block_hash import BlockHash

from .fake_executor import FakeExecutor, make_request, run_to_completion


def compute(manager, request, num_tokens):
    """Allocate and 'compute' num_tokens more tokens of request, as a step would."""
    new_ids = manager.allocate_slots(request, num_tokens)
    assert new_ids is not None
    request.num_computed_tokens += num_tokens
    manager.cache_full_blocks(request)
    return new_ids


def admit(manager, request, num_tokens=None):
    blocks, num_hit = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit if num_tokens is None else num_tokens
    assert manager.allocate_slots(request, num_new, blocks) is not None
    request.num_computed_tokens = num_hit
    return num_hit


def test_allocation_on_demand():
    manager = KVCacheManager(block_size=4, num_blocks=10, enable_prefix_caching=False)
    request = make_request("a", list(range(6)))
    assert manager.allocate_slots(request, 6) == ([1, 2],)
    request.num_computed_tokens = 6
    assert manager.allocate_slots(request, 2) == ([],)  # positions 6, 7 fit in block 2
    request.num_computed_tokens = 8
    assert manager.allocate_slots(request, 1) == ([3],)
    assert manager.block_ids("a") == ([1, 2, 3],)
    assert manager.allocate_slots(make_request("big", [1] * 40), 40) is None  # 10 blocks > 6 free
    assert manager.block_ids("big") == ([],)
    manager.check_integrity()


def test_hit_reuses_full_computed_blocks_and_caps_before_last_prompt_token():
    manager = KVCacheManager(block_size=4, num_blocks=10, enable_prefix_caching=True)
    first = make_request("a", list(range(8)))  # exactly two blocks
    compute(manager, first, 8)
    assert manager.block_pool.num_cached_blocks == 2
    same = make_request("b", list(range(8)))
    blocks, num_hit = manager.get_computed_blocks(same)
    assert num_hit == 4  # never the last prompt token: block 2 would cover position 7
    assert [b.block_id for b in blocks[0]] == manager.block_ids("a")[0][:1]
    longer = make_request("c", list(range(8)) + [50, 51])
    assert manager.get_computed_blocks(longer)[1] == 8
    assert manager.num_prefix_cached_tokens(list(range(8))) == 4
    assert manager.num_prefix_cached_tokens(list(range(9))) == 8
    assert manager.num_prefix_cached_tokens([0, 1, 2, 9, 4, 5, 6, 7, 8]) == 0


def test_hit_stops_at_first_mismatch_and_blocks_are_shared():
    manager = KVCacheManager(block_size=2, num_blocks=20, enable_prefix_caching=True)
    compute(manager, make_request("a", [1, 2, 3, 4, 5, 6, 7]), 7)
    other = make_request("b", [1, 2, 3, 4, 0, 6, 7, 8])
    assert admit(manager, other) == 4
    (a_ids,), (b_ids,) = manager.block_ids("a"), manager.block_ids("b")
    assert a_ids[:2] == b_ids[:2] and a_ids[2] != b_ids[2]
    assert manager.block_pool.blocks[a_ids[0]].ref_cnt == 2
    manager.check_integrity()


def test_hit_is_verified_against_tokens(monkeypatch):
    # Force every block key to the same digest: only the stored tokens can tell them apart.
    def colliding(parent, token_ids):
        return BlockHash(b"same", tuple(token_ids))

    monkeypatch.setattr(block_hash, "hash_block_tokens", colliding)
    monkeypatch.setattr(kv_cache_manager, "hash_block_tokens", colliding)
    manager = KVCacheManager(block_size=2, num_blocks=8, enable_prefix_caching=True)
    compute(manager, make_request("a", [1, 2, 3]), 3)
    assert manager.get_computed_blocks(make_request("b", [7, 8, 3])) == (([],), 0)
    assert manager.num_prefix_cached_tokens([1, 2, 3]) == 2
    assert manager.num_prefix_cached_tokens([7, 8, 3]) == 0


def test_generated_tokens_are_cached_once_computed():
    manager = KVCacheManager(block_size=4, num_blocks=10, enable_prefix_caching=True)
    request = make_request("a", [1, 2, 3])
    compute(manager, request, 3)
    assert manager.block_pool.num_cached_blocks == 0
    request.append_output_token(4)
    assert manager.block_pool.num_cached_blocks == 0  # token 4 is not computed yet
    request.append_output_token(5)
    compute(manager, request, 1)
    assert manager.block_pool.num_cached_blocks == 1
    assert manager.num_prefix_cached_tokens([1, 2, 3, 4, 5]) == 4


def test_freed_tails_are_evicted_first():
    manager = KVCacheManager(block_size=2, num_blocks=5, enable_prefix_caching=True)
    request = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    compute(manager, request, 7)  # blocks 1, 2, 3 full; 4 partial
    manager.remove(request)
    assert [b.block_id for b in manager.block_pool.free_queue()] == [4, 3, 2, 1]
    assert manager.block_pool.num_free_blocks == 4
    assert manager.num_prefix_cached_tokens([1, 2, 3, 4, 5, 6, 7]) == 6
    # Taking two blocks evicts the partial block and the tail block (5, 6); the prefix stays.
    other = make_request("b", [9, 9, 9])
    assert manager.allocate_slots(other, 3) == ([4, 3],)
    assert manager.num_prefix_cached_tokens([1, 2, 3, 4, 5, 6, 7]) == 4
    manager.check_integrity()


def test_hits_on_evictable_blocks_count_against_free_blocks():
    manager = KVCacheManager(block_size=2, num_blocks=4, enable_prefix_caching=True)
    compute(manager, make_request("a", [1, 2, 3, 4, 5]), 5)
    manager.remove(make_request("a", [1]))
    assert manager.block_pool.num_free_blocks == 3
    second = make_request("b", [1, 2, 3, 4, 8, 8, 8, 8, 8])  # hit 2 blocks, needs 3 more: 5 > 3
    blocks, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 4
    assert manager.allocate_slots(second, 5, blocks) is None
    assert manager.block_ids("b") == ([],) and all(b.ref_cnt == 0 for b in blocks[0])
    manager.check_integrity()


def test_num_prefix_cached_tokens_has_no_side_effects():
    manager = KVCacheManager(block_size=2, num_blocks=6, enable_prefix_caching=True)
    request = make_request("a", [1, 2, 3, 4, 5])
    compute(manager, request, 5)
    manager.remove(request)
    queue_before = [b.block_id for b in manager.block_pool.free_queue()]
    assert manager.num_prefix_cached_tokens([1, 2, 3, 4, 5]) == 4
    assert [b.block_id for b in manager.block_pool.free_queue()] == queue_before
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)


def test_disabled_prefix_caching_never_hits():
    manager = KVCacheManager(block_size=2, num_blocks=6, enable_prefix_caching=False)
    compute(manager, make_request("a", [1, 2, 3, 4, 5]), 5)
    assert manager.num_prefix_cached_tokens([1, 2, 3, 4, 5]) == 0
    assert manager.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == (([],), 0)
    assert manager.block_pool.num_cached_blocks == 0


def test_integrity_check_detects_a_wrong_ref_count():
    manager = KVCacheManager(block_size=2, num_blocks=6, enable_prefix_caching=False)
    compute(manager, make_request("a", [1, 2, 3]), 3)
    manager.block_pool.blocks[1].ref_cnt += 1
    with pytest.raises(AssertionError):
        manager.check_integrity()


def test_scheduler_reports_prefix_hit_and_outputs_do_not_change():
    config = SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    prompt = list(range(1, 15))
    outputs = {}
    for caching in (False, True):
        scheduler = Scheduler(dataclasses.replace(config, enable_prefix_caching=caching))
        executor = FakeExecutor(4, 32)
        scheduler.add_requests([make_request("a", prompt, 6)])
        run_to_completion(scheduler, executor)
        second = make_request("b", prompt + [99], 6)
        scheduler.add_requests([second])
        plan = scheduler.schedule()
        assert plan.new_requests[0].num_computed_tokens == (12 if caching else 0)
        assert plan.num_scheduled_tokens["b"] == (3 if caching else 15)
        scheduler.update_from_output(plan, executor.execute(plan))
        run_to_completion(scheduler, executor)
        assert second.num_cached_tokens == (12 if caching else 0)
        outputs[caching] = second.output_token_ids
        stats = scheduler.stats()
        assert stats.num_free_blocks == stats.num_total_blocks == 31
    assert outputs[False] == outputs[True]
