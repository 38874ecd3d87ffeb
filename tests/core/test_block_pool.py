"""BlockPool: null block, ref counts, LRU free queue, eviction of cached blocks."""

import pytest

from scheduler_svc.core.block_hash import ROOT_HASH, block_hashes_of, hash_block_tokens
from scheduler_svc.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks):
    return [block.block_id for block in blocks]


def test_null_block_is_reserved_and_uncounted():
    pool = BlockPool(5, enable_caching=True)
    assert pool.num_total_blocks == 4
    assert pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert 0 not in ids(blocks)
    assert ids(blocks) == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.free_blocks([pool.null_block])
    pool.check_integrity()


def test_at_least_two_blocks():
    with pytest.raises(ValueError):
        BlockPool(1, enable_caching=False)


def test_free_queue_remove_from_the_middle_and_ends():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3]
    assert len(queue) == 2
    queue.append(blocks[2])
    assert queue.popleft() is blocks[1]
    assert ids(queue) == [3, 2]
    with pytest.raises(ValueError):
        queue.remove(blocks[1])


def test_ref_counts_and_free_order_is_lru():
    pool = BlockPool(6, enable_caching=False)
    a = pool.get_new_blocks(3)  # 1 2 3
    pool.touch(a[:1])
    assert [b.ref_cnt for b in a] == [2, 1, 1]
    pool.free_blocks(reversed(a))  # tail first: 3, 2 join the queue; 1 still held
    assert ids(pool.free_queue()) == [4, 5, 3, 2]
    assert pool.num_free_blocks == 4
    pool.free_blocks(a[:1])
    assert ids(pool.free_queue()) == [4, 5, 3, 2, 1]
    assert ids(pool.get_new_blocks(2)) == [4, 5]
    with pytest.raises(ValueError):
        pool.free_blocks(a[:1])  # ref_cnt already 0
    pool.check_integrity()


def test_cached_free_block_is_reusable_until_evicted():
    pool = BlockPool(4, enable_caching=True)
    tokens = [1, 2, 3, 4]
    key = hash_block_tokens(ROOT_HASH, tokens)
    (block,) = pool.get_new_blocks(1)
    assert pool.cache_full_block(block, key)
    pool.free_blocks([block])
    assert pool.num_free_blocks == 3  # cached but evictable counts as free
    assert pool.num_cached_blocks == 1
    assert pool.get_cached_block(key) is block
    pool.touch([block])  # a hit unlinks it from the queue
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([block])
    # The free queue is 2, 3, 1: the cached block goes last.
    pool.get_new_blocks(2)
    assert pool.get_cached_block(key) is block
    pool.get_new_blocks(1)  # evicts it
    assert pool.get_cached_block(key) is None
    assert block.block_hash is None and pool.num_cached_blocks == 0
    pool.check_integrity()


def test_cache_hit_is_checked_against_tokens():
    pool = BlockPool(3, enable_caching=True)
    key = hash_block_tokens(ROOT_HASH, [1, 2])
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, key)
    forged = key._replace(token_ids=(9, 9))  # same digest, other tokens: a "collision"
    assert pool.get_cached_block(forged) is None
    assert pool.get_cached_block(key) is block


def test_duplicate_key_keeps_the_first_block_and_disabled_caches_nothing():
    pool = BlockPool(4, enable_caching=True)
    key = hash_block_tokens(ROOT_HASH, [5, 6])
    first, second = pool.get_new_blocks(2)
    assert pool.cache_full_block(first, key)
    assert not pool.cache_full_block(second, key)
    assert pool.get_cached_block(key) is first
    off = BlockPool(4, enable_caching=False)
    (block,) = off.get_new_blocks(1)
    assert not off.cache_full_block(block, key)
    assert off.num_cached_blocks == 0


def test_block_hashes_chain_the_parent():
    a = block_hashes_of([1, 2, 3, 4, 5], block_size=2)
    b = block_hashes_of([9, 9, 3, 4], block_size=2)
    assert len(a) == 2 and len(b) == 2
    assert a[1].token_ids == b[1].token_ids == (3, 4)
    assert a[1].hash_value != b[1].hash_value
    assert block_hashes_of([1, 2, 3, 4], 2) == a  # deterministic, partial block ignored


def test_integrity_check_detects_a_leak():
    pool = BlockPool(4, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt = 0  # corrupt: neither in use nor in the queue
    with pytest.raises(AssertionError):
        pool.check_integrity()
