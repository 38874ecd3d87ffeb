"""kernels.rotary_embedding (rotate-half) against the formula, in place on strided q/k views."""

from __future__ import annotations

import pytest
import torch

from kernels.rotary import rotary_embedding

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
MAX_POSITION = 300


def cos_sin_cache(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(MAX_POSITION, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def reference(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    half = cache.shape[1] // 2
    cos, sin = cache[positions, :half][:, None], cache[positions, half:][:, None]
    x = x.float().clone()
    x1, x2 = x[..., :half].clone(), x[..., half : 2 * half].clone()
    x[..., :half] = x1 * cos - x2 * sin
    x[..., half : 2 * half] = x2 * cos + x1 * sin
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, rotary_dim",
    [(4, 2, 64, 64), (8, 1, 128, 128), (3, 3, 80, 80), (2, 1, 64, 32)],
    ids=["gqa2", "gqa8", "d80", "partial"],
)
def test_matches_reference(num_heads, num_kv_heads, head_dim, rotary_dim, dtype, device):
    num_tokens = 17
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,))
    cache = cos_sin_cache(rotary_dim)
    q_want = reference(qkv[:, :num_heads], positions, cache)
    k_want = reference(qkv[:, num_heads : num_heads + num_kv_heads], positions, cache)

    qkv_dev = qkv.to(device)
    q, k = qkv_dev[:, :num_heads], qkv_dev[:, num_heads : num_heads + num_kv_heads]
    rotary_embedding(positions.to(device), q, k, cache.to(device))
    torch.testing.assert_close(q.cpu().float(), q_want, **TOLERANCE[dtype])
    torch.testing.assert_close(k.cpu().float(), k_want, **TOLERANCE[dtype])
    assert torch.equal(qkv_dev[:, num_heads + num_kv_heads :].cpu(), qkv[:, num_heads + num_kv_heads :])


def test_int32_positions(device):
    q, k = torch.randn(5, 2, 64, device=device), torch.randn(5, 1, 64, device=device)
    positions = torch.tensor([0, 1, 7, 299, 15], dtype=torch.int32)
    cache = cos_sin_cache(64)
    q_want, k_want = reference(q.cpu(), positions.long(), cache), reference(k.cpu(), positions.long(), cache)
    rotary_embedding(positions.to(device), q, k, cache.to(device))
    torch.testing.assert_close(q.cpu(), q_want, **TOLERANCE[torch.float32])
    torch.testing.assert_close(k.cpu(), k_want, **TOLERANCE[torch.float32])
