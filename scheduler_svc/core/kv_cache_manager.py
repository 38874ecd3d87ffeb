"""Per-request block tables over one `BlockPool`, with automatic prefix caching.

A request has one block table per KV cache group (`pagoda.step.KVCacheGroupSpec`; one
group for a model with only full attention). Each covers its computed tokens plus the
tokens scheduled this step; blocks are allocated on demand, `block_size` tokens each,
and every group's table has the same length::

    block_size = 4, num_computed_tokens = 6, 3 tokens scheduled
    positions   0 1 2 3 | 4 5 6 7 | 8 . . .
    table       [ b5    | b2      | b8     ]      cdiv(6 + 3, 4) = 3 blocks
                 full:    computed 4,5; 6,7,8 computed this step
                 cached

A block enters the prefix cache once it is full of COMPUTED tokens (`cache_full_blocks`,
called after each step), prompt or generated alike. A lookup walks the chained keys of
the request's full blocks and stops at the first miss; it never covers the last token,
whose logits the executor must compute: at most `(num_tokens - 1) // block_size` blocks.
Each group caches its own blocks; a hit is the longest prefix every group accepts
(`kv_cache_groups.find_cache_hit`: a sliding-window group needs only its window).

A sliding-window group's blocks wholly before the window of the request's next query
are freed at each allocation (`kv_cache_groups` pictures it); their entries become the
null block, which only ever leads such a table.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from pagoda.step import BlockCopy
from scheduler_svc.core.block_hash import BlockHash, extend_block_hashes, hash_block_tokens, images_in_block, root_hash
from pagoda.step import KVCacheGroupSpec
from scheduler_svc.core.block_pool import BlockPool, KVCacheBlock
from scheduler_svc.core.config import FULL_ATTENTION, cdiv
from scheduler_svc.core.kv_cache_groups import find_cache_hit, make_groups
from scheduler_svc.core.request import Request

Tables = tuple[list[KVCacheBlock], ...]  # one block table per KV cache group


class KVCacheManager:
    """Owns the block tables of one executor's requests, one per KV cache group; `BlockPool`
    owns the blocks."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_prefix_caching: bool,
        enable_kv_cache_events: bool = False,
        *,
        kv_cache_groups: Sequence[KVCacheGroupSpec] = FULL_ATTENTION,
    ) -> None:
        """`enable_kv_cache_events`: the pool records its cache's events (`BlockPool.take_events`)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not kv_cache_groups:
            raise ValueError("kv_cache_groups: at least one group")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching, enable_kv_cache_events)
        self.kv_cache_groups = tuple(kv_cache_groups)
        self._groups = make_groups(self.kv_cache_groups, block_size)
        self._num_groups = len(self._groups)
        self._sliding = tuple(g for g in self._groups if g.sliding_window is not None)
        self._full_group_id = next((g.group_id for g in self._groups if g.sliding_window is None), None)
        self._block_tables: dict[str, Tables] = {}
        self._num_hashed_blocks: dict[str, int] = {}
        self._block_hashes: dict[str, list[BlockHash]] = {}

    @property
    def num_groups(self) -> int:
        return self._num_groups

    @property
    def frees_outside_windows(self) -> bool:
        """Whether some group has a sliding window (its blocks outside it are freed as requests run)."""
        return bool(self._sliding)

    def block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group (null block entries as 0)."""
        tables = self._block_tables.get(req_id)
        if tables is None:
            return self.no_block_ids()
        return tuple([block.block_id for block in table] for table in tables)

    def no_block_ids(self) -> tuple[list[int], ...]:
        if self._num_groups == 1:  # (the common case, in every decode step of every request)
            return ([],)
        return tuple([] for _ in range(self._num_groups))

    def req_ids(self) -> set[str]:
        """Ids of the requests that hold blocks."""
        return set(self._block_tables)

    # ---- prefix cache lookups -------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[Tables, int]:
        """The cached blocks of the longest prefix of `request`, one list per group, and its token count.

        A sliding-window group's list starts with null blocks (its window needs only the
        last ones). Takes no reference: pass the blocks to `allocate_slots` to keep them.
        """
        max_blocks = (request.num_tokens - 1) // self.block_size
        if not self.enable_prefix_caching or max_blocks <= 0:
            return tuple([] for _ in range(self._num_groups)), 0
        blocks, num_blocks = find_cache_hit(self._groups, self.block_pool, self._hashes(request), max_blocks)
        return blocks, num_blocks * self.block_size

    def num_prefix_cached_tokens(self, token_ids: Sequence[int], cache_salt: str = "", images: Sequence = ()) -> int:
        """Tokens of `token_ids` (with `images`) a new request with `cache_salt` would find cached (for routing; no side effects)."""
        if not self.enable_prefix_caching:
            return 0
        size, parent, full = self.block_size, root_hash(cache_salt), self._full_group_id
        hashes: list[BlockHash] = []
        for index in range((len(token_ids) - 1) // size):  # (a hit is no longer than a full-attention group's)
            extra = (images_in_block(images, index * size, (index + 1) * size),) if images else ()
            block_hash = hash_block_tokens(parent, token_ids[index * size : (index + 1) * size], *extra)
            if full is not None and self.block_pool.get_cached_block(block_hash, full) is None:
                break
            hashes.append(block_hash)
            parent = block_hash.hash_value
        if self._num_groups == 1 and full is not None:
            return len(hashes) * size
        return find_cache_hit(self._groups, self.block_pool, hashes, len(hashes))[1] * size

    # ---- allocation -----------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]] = (),
        next_query_position: int | None = None,
    ) -> tuple[list[int], ...] | None:
        """Grow every group's table to cover `num_computed_tokens + hit + num_new_tokens` tokens.

        `new_computed_blocks` is a prefix hit (from `get_computed_blocks`, one list per
        group) of a request that holds no block yet; its tokens are not counted in
        `num_computed_tokens`. For a running request, the blocks of its sliding-window
        groups that no query from `next_query_position` on reads (default: its next one,
        `num_computed_tokens`; a request others will fork from passes theirs) are freed
        first, even when the pool then turns out short. Returns the ids of the newly
        allocated blocks, one list per group (hits excluded), or None, with no block
        taken, when the pool is short.
        """
        tables = self._block_tables.get(request.req_id)
        size = self.block_size
        if tables is not None and not new_computed_blocks and not self._sliding:  # the common case first:
            if request.num_computed_tokens + num_new_tokens <= len(tables[0]) * size:  # a decode within its block
                return ([],) if self._num_groups == 1 else self.no_block_ids()
        num_hit = len(new_computed_blocks[0]) if new_computed_blocks else 0
        if tables is not None:
            if num_hit:
                raise ValueError(f"request {request.req_id!r} already holds blocks; no prefix hit allowed")
            num_computed = request.num_computed_tokens
            if self._sliding:
                first_read = num_computed if next_query_position is None else min(next_query_position, num_computed)
                self._free_skipped(tables, first_read)
            num_held = len(tables[0])
            num_tokens = num_computed + num_new_tokens
            if num_tokens <= num_held * size:
                return self.no_block_ids()
            num_new_blocks = cdiv(num_tokens, size) - num_held
            if num_new_blocks * self._num_groups > self.block_pool.num_free_blocks:
                return None
            return self._extend(tables, num_new_blocks)
        num_tokens = request.num_computed_tokens + num_hit * size + num_new_tokens
        num_new_blocks = max(cdiv(num_tokens, size) - num_hit, 0)
        if num_new_blocks == 0 and not num_hit:
            return self.no_block_ids()
        null = self.block_pool.null_block
        hits = [block for blocks in new_computed_blocks for block in blocks if block is not null]
        num_evictable_hits = sum(1 for block in hits if block.ref_cnt == 0)
        if num_new_blocks * self._num_groups > self.block_pool.num_free_blocks - num_evictable_hits:
            return None
        self.block_pool.touch(hits)
        if num_hit:
            tables = tuple(list(blocks) for blocks in new_computed_blocks)
        else:
            tables = tuple([] for _ in range(self._num_groups))
        self._block_tables[request.req_id] = tables
        self._num_hashed_blocks[request.req_id] = num_hit
        return self._extend(tables, num_new_blocks)

    def _extend(self, tables: Tables, num_new_blocks: int) -> tuple[list[int], ...]:
        """Append `num_new_blocks` fresh blocks to every table (the pool has them); their ids per group."""
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks * self._num_groups)
        if self._num_groups == 1:
            tables[0].extend(new_blocks)
            return ([block.block_id for block in new_blocks],)
        new_ids = []
        for group_id, table in enumerate(tables):
            blocks = new_blocks[group_id * num_new_blocks : (group_id + 1) * num_new_blocks]
            table.extend(blocks)
            new_ids.append([block.block_id for block in blocks])
        return tuple(new_ids)

    def _free_skipped(self, tables: Tables, first_read: int) -> None:
        """Free the sliding-window groups' blocks wholly before the window of a query at `first_read`.

        Each table is walked back from its last skipped block to the first null (the
        earlier ones were freed before), so a step frees in O(blocks freed).
        """
        null = self.block_pool.null_block
        freed: list[KVCacheBlock] = []
        for group in self._sliding:
            table = tables[group.group_id]
            for index in range(min(group.num_skipped_blocks(first_read), len(table)) - 1, -1, -1):
                block = table[index]
                if block is null:
                    break
                freed.append(block)
                table[index] = null
        if freed:
            self.block_pool.free_blocks(freed)

    def fork(self, parent: Request, child: Request, num_prompt_tokens: int) -> list[BlockCopy] | None:
        """Give `child` the parent's computed prompt, to recompute only its last token.

        ::

            block_size = 4, prompt of 10 tokens (positions 0..9), child recomputes 9
            parent  [b1: 0-3][b2: 4-7][b3: 8 9 | parent's own tokens]
            child   [b1     ][b2     ][b9 = copy of b3]     b1, b2: ref_cnt 2

        In every group, blocks wholly before the last prompt position are shared by
        reference; the block holding it gets a fresh block (copied when it also holds
        earlier prompt positions), since the child writes that position. The parent's
        sliding-window groups must still hold the window of that position. None if fewer
        blocks than groups are free.
        """
        if child.req_id in self._block_tables:
            raise ValueError(f"request {child.req_id!r} already holds blocks")
        last_position = num_prompt_tokens - 1
        num_shared = last_position // self.block_size
        parent_tables = self._block_tables[parent.req_id]
        if len(parent_tables[0]) <= num_shared:
            raise ValueError(f"request {parent.req_id!r} has not computed its {num_prompt_tokens} prompt tokens")
        null = self.block_pool.null_block
        for group in self._sliding:
            window = parent_tables[group.group_id][group.num_skipped_blocks(last_position) : num_shared + 1]
            if any(block is null for block in window):
                raise ValueError(f"request {parent.req_id!r} freed blocks of position {last_position}'s window")
        if self.block_pool.num_free_blocks < self._num_groups:
            return None
        self.block_pool.touch([block for table in parent_tables for block in table[:num_shared] if block is not null])
        new_blocks = self.block_pool.get_new_blocks(self._num_groups)
        self._block_tables[child.req_id] = tuple(
            table[:num_shared] + [new_blocks[group_id]] for group_id, table in enumerate(parent_tables)
        )
        self._num_hashed_blocks[child.req_id] = num_shared
        if last_position % self.block_size == 0:
            return []
        return [
            BlockCopy(src=table[num_shared].block_id, dst=new_blocks[group_id].block_id)
            for group_id, table in enumerate(parent_tables)
        ]

    def fork_beams(self, parent: Request, children: Sequence[Request]) -> list[BlockCopy] | None:
        """Give `children` the parent's computed tokens, then free the parent's tables.

        ::

            block_size = 4, parent computed 10 tokens (positions 0..9), three children
            parent   [b1: 0-3][b2: 4-7][b3: 8 9 . .]
            child 0  [b1     ][b2     ][b3          ]    b3 handed over: the parent goes
            child 1  [b1     ][b2     ][b7 = copy b3]
            child 2  [b1     ][b2     ][b8 = copy b3]    b1, b2: ref_cnt 3

        In every group, full blocks (null ones too) are shared by reference; the partial
        block, which the children write next, is never shared (no copy when the computed
        tokens end on a block boundary). The parent must never run again. None, with
        nothing changed, if fewer than the blocks to copy into (`len(children) - 1` per
        group) are free.
        """
        tables = self._block_tables[parent.req_id]
        num_full, num_partial = divmod(parent.num_computed_tokens, self.block_size)
        if len(tables[0]) != cdiv(parent.num_computed_tokens, self.block_size):
            raise ValueError(f"request {parent.req_id!r} holds blocks for tokens it has not computed")
        for child in children:
            if child.req_id in self._block_tables:
                raise ValueError(f"request {child.req_id!r} already holds blocks")
        num_copies = (len(children) - 1) * self._num_groups if num_partial and children else 0
        if num_copies > self.block_pool.num_free_blocks:
            return None
        null = self.block_pool.null_block
        shared = [block for table in tables for block in table[:num_full] if block is not null]
        copies: list[BlockCopy] = []
        num_hashed = min(self._num_hashed_blocks.get(parent.req_id, 0), num_full)
        for index, child in enumerate(children):
            self.block_pool.touch(shared)
            own: Sequence[KVCacheBlock] = ()
            if num_partial and index == 0:
                own = [table[num_full] for table in tables]
                self.block_pool.touch(own)
            elif num_partial:
                own = self.block_pool.get_new_blocks(self._num_groups)
                copies += [BlockCopy(src=t[num_full].block_id, dst=b.block_id) for t, b in zip(tables, own)]
            self._block_tables[child.req_id] = tuple(
                table[:num_full] + ([own[group_id]] if own else []) for group_id, table in enumerate(tables)
            )
            self._num_hashed_blocks[child.req_id] = num_hashed
        self.free(parent)
        return copies

    def cache_full_blocks(self, request: Request) -> None:
        """Index the blocks that `request.num_computed_tokens` has filled since the last call
        (in every group; a sliding-window block already freed is not cached)."""
        if not self.enable_prefix_caching:
            return
        start = self._num_hashed_blocks.get(request.req_id, 0)
        # planned positions of tokens not sampled yet (async scheduling) have no hash yet
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= start:
            return
        tables, hashes = self._block_tables[request.req_id], self._hashes(request)
        parent = hashes[start - 1].hash_value if start else None
        for group_id, table in enumerate(tables):
            self.block_pool.cache_full_blocks(
                table[start:num_full], hashes[start:num_full], parent, request.prefix_salt, group_id
            )
        self._num_hashed_blocks[request.req_id] = num_full

    def cache_full_blocks_of(self, requests: Iterable[Request]) -> None:
        """`cache_full_blocks` for each of `requests` (a step's results), without a call per
        request when, as in most steps for most requests, no block has filled."""
        if not self.enable_prefix_caching:
            return
        num_hashed, size = self._num_hashed_blocks, self.block_size
        for request in requests:
            num_full = request.num_computed_tokens
            num_tokens = request.num_tokens
            if num_tokens < num_full:
                num_full = num_tokens
            if num_full // size > num_hashed.get(request.req_id, 0):
                self.cache_full_blocks(request)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first in every group (a preempted request keeps its hashes)."""
        tables = self._block_tables.pop(request.req_id, None)
        self._num_hashed_blocks.pop(request.req_id, None)
        if not tables:
            return
        if self._num_groups == 1 and not self._sliding:
            self.block_pool.free_blocks(reversed(tables[0]))
            return
        null = self.block_pool.null_block
        self.block_pool.free_blocks(
            block
            for index in range(len(tables[0]) - 1, -1, -1)
            for table in reversed(tables)
            if (block := table[index]) is not null
        )

    def remove(self, request: Request) -> None:
        """Forget the request entirely (finished, aborted or drained)."""
        self.free(request)
        self._block_hashes.pop(request.req_id, None)

    def _hashes(self, request: Request) -> list[BlockHash]:
        hashes = self._block_hashes.setdefault(request.req_id, [])
        extend_block_hashes(hashes, request.all_token_ids, self.block_size, request.prefix_salt, request.images)
        return hashes

    # ---- accounting -----------------------------------------------------------------------

    def kv_usage(self, requests: Iterable[Request]) -> tuple[int, int]:
        """(slots allocated, computed tokens held) over in-use blocks; a shared block counts once."""
        fill: dict[int, int] = {}
        size = self.block_size
        for request in requests:
            for table in self._block_tables.get(request.req_id, ()):
                for index, block in enumerate(table):
                    if block.block_id:
                        filled = min(max(request.num_computed_tokens - index * size, 0), size)
                        fill[block.block_id] = max(fill.get(block.block_id, 0), filled)
        num_used = self.block_pool.num_total_blocks - self.block_pool.num_free_blocks
        return num_used * size, sum(fill.values())

    def check_integrity(self, requests: Iterable[Request] = ()) -> None:
        """Raise AssertionError unless free + in use == total and every ref count == its holders.

        Every request has one table per group, all of one length; a table holds a block at
        most once, and null blocks only leading a sliding-window group's table -- for the
        `requests` given, only where no query from `num_computed_tokens` on reads.
        """
        self.block_pool.check_integrity()
        null = self.block_pool.null_block
        holders: Counter[int] = Counter()
        for req_id, tables in self._block_tables.items():
            if len(tables) != self._num_groups or len({len(table) for table in tables}) != 1:
                lengths = [len(table) for table in tables]
                raise AssertionError(f"{req_id!r} has tables of lengths {lengths} for {self._num_groups} groups")
            ids: list[int] = []
            for group, table in zip(self._groups, tables):
                num_null = _num_leading_nulls(table, null)
                if num_null and group.sliding_window is None or any(block is null for block in table[num_null:]):
                    ids_held = [block.block_id for block in table]
                    raise AssertionError(f"group {group.group_id} of {req_id!r} holds the null block: {ids_held}")
                ids += [block.block_id for block in table[num_null:]]
            if len(set(ids)) != len(ids):
                raise AssertionError(f"tables of {req_id!r} repeat a block: {ids}")
            holders.update(ids)
        for block in self.block_pool.blocks[1:]:
            if block.ref_cnt != holders[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but {holders[block.block_id]} holders"
                )
        for request in requests:
            tables = self._block_tables.get(request.req_id)
            for group in self._sliding if tables else ():
                num_skipped = group.num_skipped_blocks(request.num_computed_tokens)
                if _num_leading_nulls(tables[group.group_id], null) > num_skipped:
                    raise AssertionError(
                        f"group {group.group_id} of {request.req_id!r} freed blocks its next query reads"
                    )


def _num_leading_nulls(table: Sequence[KVCacheBlock], null: KVCacheBlock) -> int:
    count = 0
    while count < len(table) and table[count] is null:
        count += 1
    return count
