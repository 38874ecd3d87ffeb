"""Per-request block tables over one `BlockPool`, with automatic prefix caching.

A request's block table covers its computed tokens plus the tokens scheduled this step;
blocks are allocated on demand, `block_size` tokens each::

    block_size = 4, num_computed_tokens = 6, 3 tokens scheduled
    positions   0 1 2 3 | 4 5 6 7 | 8 . . .
    table       [ b5    | b2      | b8     ]      cdiv(6 + 3, 4) = 3 blocks
                 full:    computed 4,5; 6,7,8 computed this step
                 cached

A block enters the prefix cache once it is full of COMPUTED tokens (`cache_full_blocks`,
called after each step), prompt or generated alike. A lookup walks the chained keys of
the request's full blocks and stops at the first miss; it never covers the last token,
whose logits the executor must compute: at most `(num_tokens - 1) // block_size` blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from pagoda.step import BlockCopy
from scheduler_svc.core.block_hash import BlockHash, extend_block_hashes, hash_block_tokens, root_hash
from scheduler_svc.core.block_pool import BlockPool, KVCacheBlock
from scheduler_svc.core.config import cdiv
from scheduler_svc.core.request import Request


class KVCacheManager:
    """Owns the block tables of one executor's requests; `BlockPool` owns the blocks."""

    def __init__(
        self, block_size: int, num_blocks: int, enable_prefix_caching: bool, enable_kv_cache_events: bool = False
    ) -> None:
        """`enable_kv_cache_events`: the pool records its cache's events (`BlockPool.take_events`)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching, enable_kv_cache_events)
        self._block_tables: dict[str, list[KVCacheBlock]] = {}
        self._num_hashed_blocks: dict[str, int] = {}
        self._block_hashes: dict[str, list[BlockHash]] = {}

    def block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self._block_tables.get(req_id, ())]

    def req_ids(self) -> set[str]:
        """Ids of the requests that hold blocks."""
        return set(self._block_tables)

    # ---- prefix cache lookups -------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks of the longest prefix of `request` and their token count.

        Takes no reference: pass the blocks to `allocate_slots` to keep them.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in self._hashes(request)[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def num_prefix_cached_tokens(self, token_ids: Sequence[int], cache_salt: str = "") -> int:
        """Tokens of `token_ids` a new request with `cache_salt` would find cached (for routing; no side effects)."""
        if not self.enable_prefix_caching:
            return 0
        size, parent, num_hit = self.block_size, root_hash(cache_salt), 0
        for index in range((len(token_ids) - 1) // size):
            block_hash = hash_block_tokens(parent, token_ids[index * size : (index + 1) * size])
            if self.block_pool.get_cached_block(block_hash) is None:
                break
            parent, num_hit = block_hash.hash_value, num_hit + 1
        return num_hit * size

    # ---- allocation -----------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[int] | None:
        """Grow the table to cover `num_computed_tokens + hit + num_new_tokens` tokens.

        `new_computed_blocks` is a prefix hit (from `get_computed_blocks`) of a request
        that holds no block yet; its tokens are not counted in `num_computed_tokens`.
        Returns the ids of the newly allocated blocks (hits excluded), or None, with
        nothing changed, when the pool is short.
        """
        table = self._block_tables.get(request.req_id)
        if table and not new_computed_blocks:  # the common case: a decode within its last block
            if request.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
                return []
        if new_computed_blocks and table:
            raise ValueError(f"request {request.req_id!r} already holds blocks; no prefix hit allowed")
        num_held = len(table) if table else 0
        num_tokens = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        num_required = cdiv(num_tokens, self.block_size) - num_held - len(new_computed_blocks)
        if num_required <= 0 and not new_computed_blocks:
            return []
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_required > self.block_pool.num_free_blocks - num_evictable_hits:
            return None
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_required, 0))
        if table is None:
            table = self._block_tables[request.req_id] = []
            self._num_hashed_blocks[request.req_id] = len(new_computed_blocks)
        table.extend(new_computed_blocks)
        table.extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def fork(self, parent: Request, child: Request, num_prompt_tokens: int) -> list[BlockCopy] | None:
        """Give `child` the parent's computed prompt, to recompute only its last token.

        ::

            block_size = 4, prompt of 10 tokens (positions 0..9), child recomputes 9
            parent  [b1: 0-3][b2: 4-7][b3: 8 9 | parent's own tokens]
            child   [b1     ][b2     ][b9 = copy of b3]     b1, b2: ref_cnt 2

        Blocks wholly before the last prompt position are shared by reference; the
        block holding it gets a fresh block (copied when it also holds earlier prompt
        positions), since the child writes that position. None if no block is free.
        """
        if child.req_id in self._block_tables:
            raise ValueError(f"request {child.req_id!r} already holds blocks")
        last_position = num_prompt_tokens - 1
        num_shared = last_position // self.block_size
        parent_table = self._block_tables[parent.req_id]
        if len(parent_table) <= num_shared:
            raise ValueError(f"request {parent.req_id!r} has not computed its {num_prompt_tokens} prompt tokens")
        if self.block_pool.num_free_blocks < 1:
            return None
        shared = parent_table[:num_shared]
        self.block_pool.touch(shared)
        new_blocks = self.block_pool.get_new_blocks(1)
        self._block_tables[child.req_id] = shared + new_blocks
        self._num_hashed_blocks[child.req_id] = num_shared
        if last_position % self.block_size == 0:
            return []
        return [BlockCopy(src=parent_table[num_shared].block_id, dst=new_blocks[0].block_id)]

    def fork_beams(self, parent: Request, children: Sequence[Request]) -> list[BlockCopy] | None:
        """Give `children` the parent's computed tokens, then free the parent's table.

        ::

            block_size = 4, parent computed 10 tokens (positions 0..9), three children
            parent   [b1: 0-3][b2: 4-7][b3: 8 9 . .]
            child 0  [b1     ][b2     ][b3          ]    b3 handed over: the parent goes
            child 1  [b1     ][b2     ][b7 = copy b3]
            child 2  [b1     ][b2     ][b8 = copy b3]    b1, b2: ref_cnt 3

        Full blocks are shared by reference; the partial block, which the children
        write next, is never shared (no copy when the computed tokens end on a block
        boundary). The parent must never run again. None, with nothing changed, if
        fewer than the `len(children) - 1` blocks to copy into are free.
        """
        table = self._block_tables[parent.req_id]
        num_full, num_partial = divmod(parent.num_computed_tokens, self.block_size)
        if len(table) != cdiv(parent.num_computed_tokens, self.block_size):
            raise ValueError(f"request {parent.req_id!r} holds blocks for tokens it has not computed")
        for child in children:
            if child.req_id in self._block_tables:
                raise ValueError(f"request {child.req_id!r} already holds blocks")
        num_copies = len(children) - 1 if num_partial and children else 0
        if num_copies > self.block_pool.num_free_blocks:
            return None
        shared, copies = table[:num_full], []
        num_hashed = min(self._num_hashed_blocks.get(parent.req_id, 0), num_full)
        for index, child in enumerate(children):
            self.block_pool.touch(shared)
            own: list[KVCacheBlock] = []
            if num_partial and index == 0:
                own = [table[num_full]]
                self.block_pool.touch(own)
            elif num_partial:
                own = self.block_pool.get_new_blocks(1)
                copies.append(BlockCopy(src=table[num_full].block_id, dst=own[0].block_id))
            self._block_tables[child.req_id] = shared + own
            self._num_hashed_blocks[child.req_id] = num_hashed
        self.free(parent)
        return copies

    def cache_full_blocks(self, request: Request) -> None:
        """Index the blocks that `request.num_computed_tokens` has filled since the last call."""
        if not self.enable_prefix_caching:
            return
        start = self._num_hashed_blocks.get(request.req_id, 0)
        # planned positions of tokens not sampled yet (async scheduling) have no hash yet
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= start:
            return
        table, hashes = self._block_tables[request.req_id], self._hashes(request)
        parent = hashes[start - 1].hash_value if start else None
        self.block_pool.cache_full_blocks(table[start:num_full], hashes[start:num_full], parent, request.cache_salt)
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
        """Release the request's blocks, tail first (a preempted request keeps its hashes)."""
        table = self._block_tables.pop(request.req_id, None)
        self._num_hashed_blocks.pop(request.req_id, None)
        if table:
            self.block_pool.free_blocks(reversed(table))

    def remove(self, request: Request) -> None:
        """Forget the request entirely (finished, aborted or drained)."""
        self.free(request)
        self._block_hashes.pop(request.req_id, None)

    def _hashes(self, request: Request) -> list[BlockHash]:
        hashes = self._block_hashes.setdefault(request.req_id, [])
        extend_block_hashes(hashes, request.all_token_ids, self.block_size, request.cache_salt)
        return hashes

    # ---- accounting -----------------------------------------------------------------------

    def kv_usage(self, requests: Iterable[Request]) -> tuple[int, int]:
        """(slots allocated, computed tokens held) over in-use blocks; a shared block counts once."""
        fill: dict[int, int] = {}
        size = self.block_size
        for request in requests:
            for index, block in enumerate(self._block_tables.get(request.req_id, ())):
                filled = min(max(request.num_computed_tokens - index * size, 0), size)
                fill[block.block_id] = max(fill.get(block.block_id, 0), filled)
        num_used = self.block_pool.num_total_blocks - self.block_pool.num_free_blocks
        return num_used * size, sum(fill.values())

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + in use == total and every ref count == its holders."""
        self.block_pool.check_integrity()
        holders: Counter[int] = Counter()
        for req_id, table in self._block_tables.items():
            ids = [block.block_id for block in table]
            if len(set(ids)) != len(ids) or 0 in ids:
                raise AssertionError(f"table of {req_id!r} repeats a block or holds the null block: {ids}")
            holders.update(ids)
        for block in self.block_pool.blocks[1:]:
            if block.ref_cnt != holders[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but {holders[block.block_id]} holders"
                )
