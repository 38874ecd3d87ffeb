"""copy_blocks: copy-on-write of whole cache blocks, every layer's K and V in one launch.

The caches are separate allocations, so the kernel reads their base addresses from an
int64 table; program (copy, cache, chunk) copies `CHUNK` elements of block `src` into
block `dst` of one cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

import kernels._interpreter  # noqa: F401  (interpreter fix, when interpreting)

_CHUNK = 2048


@triton.jit
def _copy_blocks_kernel(
    cache_ptrs_ptr,  # [num_caches] int64 base addresses
    dtype_ref_ptr,  # caches[0]: lends the element type
    src_dst_ptr,  # [num_copies, 2] int64
    block_numel,
    stride_cache_block,
    stride_src_dst_copy,
    CHUNK: tl.constexpr,
):
    copy = tl.program_id(0)
    cache = tl.program_id(1)
    chunk = tl.program_id(2)
    src = tl.load(src_dst_ptr + copy * stride_src_dst_copy)
    dst = tl.load(src_dst_ptr + copy * stride_src_dst_copy + 1)
    base = tl.load(cache_ptrs_ptr + cache).to(dtype_ref_ptr.dtype)

    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    x = tl.load(base + src * stride_cache_block + offs, mask=mask)
    tl.store(base + dst * stride_cache_block + offs, x, mask=mask)


def copy_blocks(caches: Sequence[torch.Tensor], src_dst: torch.Tensor) -> None:
    """For each row (src, dst) of `src_dst` [num_copies, 2] int64, copy block src into block dst of every cache.

    The caches (typically each layer's K and V) must be contiguous and share shape
    [num_blocks, ...], dtype and device. No dst may also appear as a src or twice as a dst:
    copies run in parallel.
    """
    if not caches:
        return
    first = caches[0]
    for cache in caches:
        if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
            raise ValueError("every cache must share shape, dtype and device")
        if not cache.is_contiguous():
            raise ValueError("caches must be contiguous")
    if src_dst.dim() != 2 or src_dst.shape[1] != 2 or src_dst.dtype != torch.int64:
        raise ValueError(f"src_dst must be int64 [num_copies, 2], got {src_dst.dtype} {tuple(src_dst.shape)}")
    if src_dst.device != first.device or src_dst.stride(1) != 1:
        raise ValueError(f"src_dst must be on {first.device} with a unit last stride")
    num_copies = src_dst.shape[0]
    if num_copies == 0:
        return

    cache_ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=first.device)
    block_numel = first[0].numel()
    grid = (num_copies, len(caches), triton.cdiv(block_numel, _CHUNK))
    _copy_blocks_kernel[grid](
        cache_ptrs,
        first,
        src_dst,
        block_numel,
        first.stride(0),
        src_dst.stride(0),
        **copy_blocks_config(),
    )


def copy_blocks_config() -> dict[str, object]:
    """The constexprs `copy_blocks` launches `_copy_blocks_kernel` with (one choice for every cache)."""
    return dict(CHUNK=_CHUNK)
