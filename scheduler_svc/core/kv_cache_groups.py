"""What differs between KV cache groups of different attention types (vLLM's single-type managers).

Each group of layers (`pagoda.step.KVCacheGroupSpec`) has its own block table per
request, all over one `BlockPool`. Two rules depend on the group's attention type:

* which leading blocks of a table no future query reads (`num_skipped_blocks`): none
  for full attention; for a sliding window W, the blocks wholly before position
  `p - W + 1` once the next query is at position p. Those are freed while the request
  runs, and their entries become the null block::

      window 6, block_size 4, next query at p = 13: it reads positions 8..13
      positions   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13
      table       [ null  |  null   |  b7       | b9   ]    (8 - 0) // 4 = 2 skipped

* what a prefix-cache hit of h tokens needs (`find_longest_cache_hit`): full attention,
  every block before h (scan left to right, stop at the first miss); a sliding window,
  only the blocks of positions h - W + 1 .. h - 1, cdiv(W - 1, block_size) blocks (scan
  right to left, stop at the first run that long). The hit blocks of a sliding-window
  group are those, after nulls.

`find_cache_hit` intersects the groups' hits: the longest h that every group accepts,
found by shrinking a candidate until no group shrinks it further (vLLM's
HybridKVCacheCoordinator).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.step import KVCacheGroupSpec
from scheduler_svc.core.block_hash import BlockHash
from scheduler_svc.core.block_pool import BlockPool, KVCacheBlock
from scheduler_svc.core.config import cdiv


@dataclass(frozen=True)
class FullAttentionGroup:
    group_id: int
    block_size: int
    sliding_window = None

    def num_skipped_blocks(self, next_query_position: int) -> int:
        return 0

    def find_longest_cache_hit(
        self, pool: BlockPool, hashes: Sequence[BlockHash], max_blocks: int
    ) -> list[KVCacheBlock]:
        """The cached blocks of the longest prefix of at most `max_blocks` blocks."""
        blocks = []
        for block_hash in hashes[:max_blocks]:
            block = pool.get_cached_block(block_hash, self.group_id)
            if block is None:
                break
            blocks.append(block)
        return blocks


@dataclass(frozen=True)
class SlidingWindowGroup:
    group_id: int
    block_size: int
    sliding_window: int

    def num_skipped_blocks(self, next_query_position: int) -> int:
        """Leading blocks wholly before the window of a query at `next_query_position` (and every later one)."""
        return max(next_query_position - self.sliding_window + 1, 0) // self.block_size

    def find_longest_cache_hit(
        self, pool: BlockPool, hashes: Sequence[BlockHash], max_blocks: int
    ) -> list[KVCacheBlock]:
        """Nulls, then the cached blocks of the window before the longest hit of at most `max_blocks` blocks.

        A hit ending at block h needs blocks h - need .. h - 1 cached (need = cdiv(W - 1,
        block_size)), or blocks 0 .. h - 1 when h < need (the window starts before the
        sequence).
        """
        null = pool.null_block
        need = cdiv(self.sliding_window - 1, self.block_size)
        if need == 0:  # a window of one token: a query reads only itself
            return [null] * max_blocks
        blocks = [null] * max_blocks
        run = 0
        for index in range(max_blocks - 1, -1, -1):
            block = pool.get_cached_block(hashes[index], self.group_id)
            if block is None:
                run = 0
                continue
            blocks[index] = block
            run += 1
            if run >= need:
                del blocks[index + run :]
                return blocks
        del blocks[run:]  # no run of `need`: the run that starts at block 0, if any
        return blocks


AttentionGroup = FullAttentionGroup | SlidingWindowGroup


def make_groups(specs: Sequence[KVCacheGroupSpec], block_size: int) -> tuple[AttentionGroup, ...]:
    return tuple(
        FullAttentionGroup(group_id, block_size)
        if spec.sliding_window is None
        else SlidingWindowGroup(group_id, block_size, spec.sliding_window)
        for group_id, spec in enumerate(specs)
    )


def find_cache_hit(
    groups: Sequence[AttentionGroup], pool: BlockPool, hashes: Sequence[BlockHash], max_blocks: int
) -> tuple[tuple[list[KVCacheBlock], ...], int]:
    """Every group's hit blocks for the longest prefix (in blocks, at most `max_blocks`) all groups
    accept, and its length in blocks.

    Full-attention groups go first (their left-to-right scan bounds the rest tightly) and
    are looked up once: a prefix of a full-attention hit is a hit. A sliding-window group
    is asked again whenever another group shortens the candidate.
    """
    num_blocks = max_blocks
    found: list[list[KVCacheBlock]] = [[] for _ in groups]
    full = [g for g in groups if g.sliding_window is None]
    for group in full:
        found[group.group_id] = group.find_longest_cache_hit(pool, hashes, num_blocks)
        num_blocks = min(num_blocks, len(found[group.group_id]))
    sliding = [g for g in groups if g.sliding_window is not None]
    settled = False
    while not settled:
        settled = True
        for group in sliding:
            blocks = group.find_longest_cache_hit(pool, hashes, num_blocks)
            found[group.group_id] = blocks
            if len(blocks) < num_blocks:
                num_blocks, settled = len(blocks), False
                break
    for group in full:
        del found[group.group_id][num_blocks:]
    return tuple(found), num_blocks
