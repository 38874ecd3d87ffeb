"""The KV blocks of one executor: ref counts, the free queue and the prefix-cache index.

::

    block 0          the null block: never handed out, never freed, in no count
    ref_cnt > 0      in use: held by `ref_cnt` block tables
    ref_cnt == 0     free: in the free queue, maybe still cached (hash kept) until evicted

    free queue (LRU):  head -> [b7][b3 #h][b9 #h] ... [b2] <- tail
                       allocate pops the head (dropping its hash: eviction);
                       free appends to the tail; a cache hit unlinks from anywhere, O(1).

Invariant: `num_free_blocks + num_used_blocks == num_total_blocks`, where the totals
exclude the null block.

One pool serves every KV cache group of the executor (`pagoda.step.KVCacheGroupSpec`):
a block in use belongs to one group's table, and the prefix index is keyed by (group,
block hash), so the same tokens of different groups are cached and evicted apart, in
one LRU queue (vLLM's hybrid KV cache manager). Block tables may hold the null block
(a sliding-window group's blocks outside the window); it is never counted or freed.

Blocks are made lazily: a block never handed out sits, in id order, at the head of the
free queue (nothing is ever put before it), so the pool keeps only a count of them and
makes each one when it is first allocated. Creating a pool is O(1) whatever its size (an
executor registering 3 million blocks used to hold the event loop for ~10 s); `blocks`
holds the blocks made so far, ids 0..len-1.

With `enable_kv_cache_events` the pool records what enters and leaves the prefix cache
(`core/kv_events.py`) until `take_events()` drains them: a router follows the real cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from scheduler_svc.core.block_hash import BlockHash
from scheduler_svc.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


class KVCacheBlock:
    """One block of KV slots. `block_hash` (and `group_id`, its KV cache group) is set while
    the block is in the prefix cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_id", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group_id = 0
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = " cached" if self.block_hash is not None else ""
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed at the head.

    Sentinel head and tail nodes keep every operation branch-free and O(1).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def prepend(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put `blocks`, in order, before the current head."""
        prev = self._head
        for block in blocks:
            self._link_after(prev, block)
            prev = block

    def _link_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = prev.next_free
        assert nxt is not None
        prev.next_free = block
        block.prev_free = prev
        block.next_free = nxt
        nxt.prev_free = block
        self._len += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        self._link_after(last, block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1


class BlockPool:
    """Owns every block of one executor's KV cache.

    Blocks move between "free" and "in use" only here: `get_new_blocks` and `touch`
    take references, `free_blocks` drops them. Callers free a request's blocks tail
    first so that, in LRU order, a prefix outlives its continuations.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, enable_kv_cache_events: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.enable_caching = enable_caching
        self._num_blocks = num_blocks
        self.blocks = [KVCacheBlock(0)]  # made so far (ids 0..len-1); the rest are fresh
        self.null_block = self.blocks[0]
        self._free_queue = FreeBlockQueue(())  # free blocks that were handed out before
        self._cached: dict[tuple[int, bytes], KVCacheBlock] = {}  # (group id, hash value) -> block
        self._events: list[KVCacheEvent] | None = [] if enable_kv_cache_events and enable_caching else None

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self._num_fresh + len(self._free_queue)

    @property
    def _num_fresh(self) -> int:
        return self._num_blocks - len(self.blocks)

    def _make_fresh(self, count: int) -> list[KVCacheBlock]:
        start = len(self.blocks)
        made = [KVCacheBlock(block_id) for block_id in range(start, start + count)]
        self.blocks.extend(made)
        return made

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_queue(self) -> list[KVCacheBlock]:
        """The free blocks, next to be evicted first (for tests and checks: makes every fresh block)."""
        self._free_queue.prepend(self._make_fresh(self._num_fresh))
        return list(self._free_queue)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks off the head of the free queue, evicting their hashes."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = self._make_fresh(min(num_blocks, self._num_fresh))  # the head of the queue
        for _ in range(num_blocks - len(blocks)):
            block = self._free_queue.popleft()
            self._evict(block)
            blocks.append(block)
        for block in blocks:
            block.ref_cnt = 1
        return blocks

    def get_cached_block(self, block_hash: BlockHash, group_id: int = 0) -> KVCacheBlock | None:
        """Group `group_id`'s cached block for `block_hash`, if its stored tokens match exactly."""
        block = self._cached.get((group_id, block_hash.hash_value))
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a cache hit or a shared fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; the ones reaching 0 join the queue's tail in order."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise ValueError(f"freeing {block!r}, which is not in use")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash, group_id: int = 0) -> bool:
        """Index a block of group `group_id` full of computed tokens; False if disabled or that key is cached."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        key = (group_id, block_hash.hash_value)
        if key in self._cached:
            return False
        block.block_hash, block.group_id = block_hash, group_id
        self._cached[key] = block
        return True

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        parent_hash: bytes | None,
        cache_salt: str,
        group_id: int = 0,
    ) -> None:
        """`cache_full_block` for a run of a request's blocks of group `group_id`, `parent_hash`
        the key before the first (None: the first block of the request). Records one
        BlockStored per stretch of blocks newly cached (a block whose key another block holds,
        or a null block -- a sliding window's, freed before it was cached -- breaks the
        stretch). Events follow group 0 only (the full-attention group where there is one):
        a router sees one copy of each prefix, not one per group."""
        stretch: list[BlockHash] = []
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block is not self.null_block and self.cache_full_block(block, block_hash, group_id):
                stretch.append(block_hash)
                continue
            self._record_stored(stretch, parent_hash, cache_salt, group_id)
            stretch, parent_hash = [], block_hash.hash_value
        self._record_stored(stretch, parent_hash, cache_salt, group_id)

    def _record_stored(self, stretch: list[BlockHash], parent_hash: bytes | None, cache_salt: str, group_id: int = 0) -> None:
        if self._events is None or not stretch or group_id:
            return
        self._events.append(BlockStored(tuple(stretch), parent_hash, cache_salt))

    def reset_prefix_cache(self) -> bool:
        """Drop every key from the prefix cache, if no block is in use; False (nothing done) otherwise."""
        if self.num_free_blocks != self.num_total_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first ([] when events are off)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        del self._cached[(block.group_id, block.block_hash.hash_value)]
        if self._events is not None and block.group_id == 0:
            self._events.append(BlockRemoved((block.block_hash.hash_value,)))
        block.block_hash = None

    def check_integrity(self) -> None:
        """Raise AssertionError unless the queue, the ref counts and the index agree."""
        free = self.free_queue()
        if len(free) != self.num_free_blocks:
            raise AssertionError(f"free queue walks {len(free)} blocks, counts {self.num_free_blocks}")
        if any(block.ref_cnt != 0 for block in free) or self.null_block in free:
            raise AssertionError("a block in the free queue is in use or is the null block")
        num_used = sum(1 for block in self.blocks[1:] if block.ref_cnt > 0)
        if num_used + len(free) != self.num_total_blocks:
            raise AssertionError(f"free {len(free)} + in use {num_used} != total {self.num_total_blocks}")
        for (group_id, hash_value), block in self._cached.items():
            if block.block_hash is None or (block.group_id, block.block_hash.hash_value) != (group_id, hash_value):
                raise AssertionError(f"prefix index entry for {block!r} has the wrong key")
        if sum(block.block_hash is not None for block in self.blocks) != len(self._cached):
            raise AssertionError("a block carries a hash but is not in the prefix index")
