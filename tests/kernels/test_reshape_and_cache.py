"""kernels.reshape_and_cache against plain indexing; slot -1 must leave the cache untouched."""

from __future__ import annotations

import pytest
import torch

from kernels.reshape_and_cache import reshape_and_cache
from tests.kernels.conftest import skip_unless_the_gpu_converts

# (dtype, largest finite value): --kv-cache-dtype fp8_e4m3 and fp8_e5m2
FP8_FORMATS = [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)]
FP8_IDS = ["e4m3", "e5m2"]


def make_inputs(num_tokens, num_kv_heads, head_dim, block_size, dtype, device, *, num_blocks=7, num_skipped=3):
    """Strided key/value views (as split from a fused qkv output), distinct random slots, some -1."""
    kv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, dtype=dtype, device=device)
    key, value = kv[:, :num_kv_heads], kv[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[torch.randperm(num_tokens)[:num_skipped]] = -1
    return key, value, slots.to(device)


def expected_cache(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    out = cache.clone().cpu()
    written = slots.cpu() >= 0
    out.flatten(0, 1)[slots.cpu()[written]] = x.cpu()[written].to(out.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads, head_dim", [(2, 64), (3, 80), (8, 128)])
def test_writes_slots(num_kv_heads, head_dim, block_size, dtype, device):
    key, value, slots = make_inputs(17, num_kv_heads, head_dim, block_size, dtype, device)
    k_cache = torch.randn(7, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    want_k, want_v = expected_cache(k_cache, key, slots), expected_cache(v_cache, value, slots)
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.cpu(), want_k)
    assert torch.equal(v_cache.cpu(), want_v)


@pytest.mark.parametrize("fp8, fp8_max", FP8_FORMATS, ids=FP8_IDS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_fp8_quantises(block_size, fp8, fp8_max, device):
    """Values on the FP8 grid times the scale quantise exactly; past the largest times the scale they saturate."""
    skip_unless_the_gpu_converts(fp8, device)
    k_scale, v_scale = 2.0**-5, 2.0**-3
    key, value, slots = make_inputs(17, 2, 64, block_size, torch.bfloat16, device)
    key = (key.float().to(fp8).float() * k_scale).to(torch.bfloat16)
    value = (value.float().to(fp8).float() * v_scale).to(torch.bfloat16)
    key[0, 0, :4] = torch.tensor([3 * fp8_max * k_scale, -3 * fp8_max * k_scale, fp8_max * k_scale, -fp8_max * k_scale])
    slots[0] = 5
    k_cache = torch.zeros(7, block_size, 2, 64, dtype=fp8, device=device)
    v_cache = torch.zeros_like(k_cache)
    reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)

    for cache, x, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        want = expected_cache(torch.zeros(cache.shape), x.float() / scale, slots)
        assert torch.equal(cache.float().cpu(), want.clamp(-fp8_max, fp8_max))
    assert k_cache.float().cpu().flatten(0, 1)[5, 0, :4].tolist() == [fp8_max, -fp8_max, fp8_max, -fp8_max]


@pytest.mark.parametrize("fp8, fp8_max", FP8_FORMATS, ids=FP8_IDS)
def test_fp8_rounds_like_torch(fp8, fp8_max, device):
    skip_unless_the_gpu_converts(fp8, device)
    key, value, slots = make_inputs(17, 2, 64, 16, torch.bfloat16, device)
    key[0, 0, :3] = torch.tensor([1e-6, -3e-7, 0.0])  # subnormal in both formats after / 0.01
    k_cache = torch.zeros(7, 16, 2, 64, dtype=fp8, device=device)
    v_cache = torch.zeros_like(k_cache)
    reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale=0.01, v_scale=0.02)
    want = expected_cache(torch.zeros(k_cache.shape), (key.float() / 0.01).clamp(-fp8_max, fp8_max), slots)
    assert torch.equal(k_cache.float().cpu(), want.to(fp8).float())
    want_v = expected_cache(torch.zeros(v_cache.shape), (value.float() / 0.02).clamp(-fp8_max, fp8_max), slots)
    assert torch.equal(v_cache.float().cpu(), want_v.to(fp8).float())


def test_rejects_bad_inputs(device):
    key, value, slots = make_inputs(4, 2, 64, 16, torch.float32, device, num_skipped=0)
    k_cache = torch.zeros(7, 16, 2, 64, device=device)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(key, value, k_cache, k_cache.clone(), slots.int())
    with pytest.raises(ValueError, match="float8"):
        reshape_and_cache(key, value, k_cache, k_cache.clone(), slots, k_scale=0.5)
    with pytest.raises(ValueError, match="does not hold"):
        reshape_and_cache(key[:, :1], value[:, :1], k_cache, k_cache.clone(), slots)
