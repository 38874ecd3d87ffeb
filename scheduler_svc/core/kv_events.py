"""What happens to one executor's prefix cache, as events (vLLM's `BlockStored` / `BlockRemoved` /
`AllBlocksCleared`, `vllm/distributed/kv_events.py`).

A `BlockPool` built with `enable_kv_cache_events` records them in order, and its owner drains
them with `take_events()` once a step; the gRPC layer turns them into the KV-event stream a
router's cache-aware routing follows (`scheduler_svc/vllm_engine/kv_events.py`)::

    cache_full_blocks(run)   -> BlockStored(blocks=(k2, k3), parent_block_hash=h1)    k: BlockHash (h + tokens)
    allocate (evicts b7)     -> BlockRemoved(block_hashes=[h3])
    reset_prefix_cache()     -> AllBlocksCleared()

`parent_block_hash` is None for the first block of a request (its parent is the salt's root,
not a block); `cache_salt` is the request's, so a consumer can tell whose blocks they are.
Hashes are the pool's own keys (`BlockHash.hash_value`, 16 bytes); a stored block is its
`BlockHash` itself (the key and its tokens, the very tuple the pool keeps: nothing is copied).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.core.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """Blocks that entered the prefix cache: a chain, each the parent of the next."""

    blocks: tuple[BlockHash, ...]
    parent_block_hash: bytes | None
    cache_salt: str

    @property
    def block_hashes(self) -> tuple[bytes, ...]:
        return tuple(block.hash_value for block in self.blocks)


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache (their KV slots are being reused)."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block left the prefix cache (a reset, or the executor is gone)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
