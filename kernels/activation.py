"""SiLU-and-multiply, the gated MLP activation: `[gate | up]` [num_tokens, 2 * I] -> silu(gate) * up [num_tokens, I]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernels._interpreter  # noqa: F401  (interpreter fix, when interpreting)

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [num_tokens, intermediate]
    x_ptr,  # [num_tokens, 2 * intermediate]
    intermediate,
    stride_out_token,
    stride_x_token,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    row = x_ptr + token * stride_x_token
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + token * stride_out_token + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for `x` [num_tokens, 2 * I]; computed in fp32, returned in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [num_tokens, 2 * I] with a unit last stride, got {tuple(x.shape)} {x.stride()}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"x must be floating point, got {x.dtype}")
    num_tokens, intermediate = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, intermediate, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    config = silu_and_mul_config(intermediate)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, config["BLOCK"]))](
        out, x, intermediate, out.stride(0), x.stride(0), **config
    )
    return out


def silu_and_mul_config(intermediate: int) -> dict[str, object]:
    """The constexprs `silu_and_mul` launches `_silu_and_mul_kernel` with for rows of 2 * `intermediate`."""
    return dict(BLOCK=min(_BLOCK, triton.next_power_of_2(intermediate)))
