"""kernels.rms_norm / fused_add_rms_norm against the Hugging Face Llama formula."""

from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import fused_add_rms_norm, rms_norm

# bf16 allows 2 ulps: the interpreter (CPU) truncates fp32 -> bf16 where the GPU rounds to nearest.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}
EPS = 1e-6


def reference(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    variance = h.float().pow(2).mean(-1, keepdim=True)
    return weight * (h.float() * torch.rsqrt(variance + EPS)).to(h.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_rows, hidden", [(1, 64), (17, 100), (5, 4096)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_matches_reference(with_residual, num_rows, hidden, dtype, device):
    x_dev = torch.randn(num_rows, hidden + 8, dtype=dtype, device=device)[:, :hidden]  # strided rows
    weight_dev = 1 + 0.1 * torch.randn(hidden, dtype=dtype, device=device)
    residual_dev = torch.randn(num_rows, hidden, dtype=dtype, device=device)
    x, weight, residual = x_dev.cpu(), weight_dev.cpu(), residual_dev.cpu()
    if with_residual:
        out, new_residual = fused_add_rms_norm(x_dev, residual_dev, weight_dev, EPS)
        h = x + residual
        exact = device.type == "cuda" or dtype == torch.float32  # see TOLERANCE
        torch.testing.assert_close(new_residual.cpu(), h, atol=0, rtol=0 if exact else 2**-7)
        assert torch.equal(residual_dev.cpu(), residual)  # inputs untouched
    else:
        out, h = rms_norm(x_dev, weight_dev, EPS), x
    assert out.dtype == dtype and out.shape == (num_rows, hidden)
    torch.testing.assert_close(out.cpu(), reference(h, weight), **TOLERANCE[dtype])


def test_rejects_bad_weight(device):
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 64, device=device), torch.ones(63, device=device), EPS)
