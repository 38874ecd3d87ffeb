"""kernels.copy_blocks: every layer's K and V, one launch, bit-exact."""

from __future__ import annotations

import pytest
import torch

from kernels.copy_blocks import copy_blocks

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8], ids=["fp32", "bf16", "fp8"])
def test_copies_every_cache(dtype, device):
    caches = [torch.randn(9, 16, 3, 80).to(dtype).to(device) for _ in range(2 * 3)]  # 3 layers x (K, V)
    src_dst = torch.tensor([[1, 4], [2, 7], [6, 3]], device=device)
    want = [c.cpu().view(torch.uint8).clone() for c in caches]
    for w in want:
        w.index_copy_(0, src_dst[:, 1].cpu(), w.index_select(0, src_dst[:, 0].cpu()))
    copy_blocks(caches, src_dst)
    for cache, w in zip(caches, want):
        assert torch.equal(cache.cpu().view(torch.uint8), w)


def test_no_copies_is_a_no_op(device):
    caches = [torch.randn(3, 16, 1, 64, device=device)]
    before = caches[0].clone()
    copy_blocks(caches, torch.empty(0, 2, dtype=torch.int64, device=device))
    assert torch.equal(caches[0], before)


def test_rejects_mismatched_caches(device):
    caches = [torch.zeros(3, 16, 1, 64, device=device), torch.zeros(4, 16, 1, 64, device=device)]
    with pytest.raises(ValueError, match="share shape"):
        copy_blocks(caches, torch.tensor([[1, 2]], device=device))
