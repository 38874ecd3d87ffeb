"""kernels.silu_and_mul against F.silu(gate) * up."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens, intermediate", [(1, 64), (17, 1000), (3, 2304)])
def test_matches_reference(num_tokens, intermediate, dtype, device):
    x = (3 * torch.randn(num_tokens, 2 * intermediate + 16, dtype=dtype, device=device))[:, : 2 * intermediate]
    assert x.stride(0) == 2 * intermediate + 16
    gate, up = x.float().cpu().chunk(2, dim=-1)
    out = silu_and_mul(x)
    assert out.dtype == dtype and out.shape == (num_tokens, intermediate)
    torch.testing.assert_close(out.cpu().float(), F.silu(gate) * up, **TOLERANCE[dtype])


def test_rejects_odd_width(device):
    with pytest.raises(ValueError, match="2 \\* I"):
        silu_and_mul(torch.randn(2, 7, device=device))
