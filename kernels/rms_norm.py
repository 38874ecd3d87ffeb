"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer.

Per row, as Hugging Face Llama computes it::

    h   = x + residual                     (rounded to x's dtype; this is the new residual)
    out = weight * (h / sqrt(mean(h^2) + eps)).to(x.dtype)      statistics in fp32
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernels._interpreter  # noqa: F401  (interpreter fix, when interpreting)

_MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_rows, hidden]
    residual_out_ptr,  # [num_rows, hidden] (HAS_RESIDUAL only)
    x_ptr,  # [num_rows, hidden]
    residual_ptr,  # [num_rows, hidden] (HAS_RESIDUAL only)
    weight_ptr,  # [hidden]
    eps,
    stride_out_row,
    stride_residual_out_row,
    stride_x_row,
    stride_residual_row,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    h = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual_ptr + row * stride_residual_row + cols, mask=mask, other=0.0).to(tl.float32)
        h = h.to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out_row + cols, h, mask=mask)
        h = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / HIDDEN + eps)
    normed = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out_row + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of `x` [num_rows, hidden]; returns a new tensor like x."""
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns `(rms_norm(x + residual), x + residual)` as new tensors; the inputs are untouched."""
    out, residual_out = _launch(x, residual, weight, eps)
    assert residual_out is not None
    return out, residual_out


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [num_rows, hidden] with a unit last stride, got {tuple(x.shape)} {x.stride()}")
    num_rows, hidden = x.shape
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"hidden {hidden} exceeds {_MAX_HIDDEN}")
    if weight.shape != (hidden,) or not weight.is_contiguous() or weight.device != x.device:
        raise ValueError(f"weight must be contiguous [{hidden}] on {x.device}, got {tuple(weight.shape)}")
    if not x.dtype.is_floating_point or not weight.dtype.is_floating_point:
        raise ValueError(f"x ({x.dtype}) and weight ({weight.dtype}) must be floating point")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(
                f"residual must match x {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}"
            )
        if residual.stride(1) != 1:
            raise ValueError("residual needs a unit last stride")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(out) if residual is not None else None
    if num_rows == 0:
        return out, residual_out

    _rms_norm_kernel[(num_rows,)](
        out,
        residual_out if residual_out is not None else out,
        x,
        residual if residual is not None else x,
        weight,
        eps,
        out.stride(0),
        residual_out.stride(0) if residual_out is not None else 0,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        **rms_norm_config(hidden, residual is not None),
    )
    return out, residual_out


def rms_norm_config(hidden: int, has_residual: bool) -> dict[str, object]:
    """The keyword arguments (constexprs, num_warps) `_rms_norm_kernel` is launched with for rows of `hidden`."""
    block = triton.next_power_of_2(hidden)
    return dict(HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=has_residual, num_warps=min(max(block // 256, 1), 16))
