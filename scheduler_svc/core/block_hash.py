"""Prefix-cache keys: one per FULL block, chained through the parent block's key.

::

    tokens   [t0 t1 t2 t3][t4 t5 t6 t7][t8 t9 .  . ]      block_size = 4
    hashes   h0 = H(ROOT, t0..t3)
                           h1 = H(h0, t4..t7)
                                        (partial: no key, never cached)

`h1` identifies the whole prefix t0..t7, not just t4..t7. The block's own tokens
are kept beside the hash so that a lookup verifies them instead of trusting the
digest. blake2b gives the same keys in every process.

A request's cache salt (its tenant and `GenerateRequest.cache_salt`) replaces ROOT by
`root_hash(salt)`: the first block's key, and so every key after it, differs between
salts, so requests with different salts never share a block, nor learn from a hit's
timing that another tenant sent the same prefix (CVE-2025-46570). The tokens check
cannot tell salts apart; the chain does.

A vision-language request's image placeholder tokens are the same for every image, so a block's
key also takes the content hash of each image whose placeholder span overlaps the block (as
vLLM's extra keys do): the same image and text hit, another image does not.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b
from typing import NamedTuple

ROOT_HASH = b"pagoda-prefix-root"


class BlockHash(NamedTuple):
    """Key of a full block: the chained digest and the block's own token ids."""

    hash_value: bytes
    token_ids: tuple[int, ...]


def root_hash(cache_salt: str = "") -> bytes:
    """The parent key of a request's first block: ROOT_HASH unsalted, else a digest of the salt."""
    if not cache_salt:
        return ROOT_HASH
    return blake2b(cache_salt.encode(), digest_size=16, key=ROOT_HASH).digest()


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int], image_hashes: Sequence[str] = ()) -> BlockHash:
    """The key of a full block holding `token_ids` after the prefix keyed `parent_hash`
    (`image_hashes`: the content hashes of the images whose placeholders it holds)."""
    digest = blake2b(parent_hash, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    for image_hash in image_hashes:
        digest.update(b"|image:" + image_hash.encode())
    return BlockHash(digest.digest(), tuple(token_ids))


def images_in_block(images: Sequence, start: int, end: int) -> tuple[str, ...]:
    """The hashes of `images` (`pagoda.step.ImageInput`s) whose placeholder span overlaps [start, end)."""
    return tuple(image.hash for image in images if image.offset < end and image.offset + image.length > start)


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, cache_salt: str = "", images: Sequence = ()
) -> None:
    """Append the keys of the full blocks of `token_ids` that `hashes` lacks (in place)."""
    num_full_blocks = len(token_ids) // block_size
    parent = hashes[-1].hash_value if hashes else root_hash(cache_salt)
    for index in range(len(hashes), num_full_blocks):
        start = index * block_size
        extra = (images_in_block(images, start, start + block_size),) if images else ()
        block_hash = hash_block_tokens(parent, token_ids[start : start + block_size], *extra)
        hashes.append(block_hash)
        parent = block_hash.hash_value


def block_hashes_of(token_ids: Sequence[int], block_size: int, cache_salt: str = "", images: Sequence = ()) -> list[BlockHash]:
    """The keys of every full block of `token_ids`."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, block_size, cache_salt, images)
    return hashes
