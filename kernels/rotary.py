"""Rotary position embedding, Llama / GPT-NeoX style (rotate-half), applied in place to q and k.

`cos_sin_cache` [max_position, rotary_dim] holds `cos(pos * inv_freq)` in its first half and
`sin(pos * inv_freq)` in its second (any attention scaling already folded in). For each head
the first `rotary_dim` dims are split into halves x1, x2::

    x1' = x1 * cos - x2 * sin
    x2' = x2 * cos + x1 * sin          dims >= rotary_dim are left as they are
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernels._interpreter  # noqa: F401  (interpreter fix, when interpreting)


@triton.jit
def _rotate_heads(
    x_ptr, token, stride_token, stride_head, cos, sin, NUM_HEADS: tl.constexpr, NUM_HEADS_PADDED: tl.constexpr,
    HALF: tl.constexpr, HALF_PADDED: tl.constexpr,
):
    heads = tl.arange(0, NUM_HEADS_PADDED)
    dims = tl.arange(0, HALF_PADDED)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HALF)
    first = x_ptr + token * stride_token + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    positions_ptr,  # [num_tokens]
    cos_sin_cache_ptr,  # [max_position, rotary_dim]
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cos_sin_cache_position,
    NUM_HEADS: tl.constexpr,
    NUM_HEADS_PADDED: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    NUM_KV_HEADS_PADDED: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PADDED)
    row = cos_sin_cache_ptr + position * stride_cos_sin_cache_position
    cos = tl.load(row + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, token, stride_q_token, stride_q_head, cos, sin, NUM_HEADS, NUM_HEADS_PADDED, HALF, HALF_PADDED)
    _rotate_heads(
        k_ptr, token, stride_k_token, stride_k_head, cos, sin, NUM_KV_HEADS, NUM_KV_HEADS_PADDED, HALF, HALF_PADDED
    )


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate `q` [num_tokens, num_heads, head_dim] and `k` [num_tokens, num_kv_heads, head_dim] in place.

    `positions` [num_tokens] (int32 or int64) index `cos_sin_cache` [max_position, rotary_dim],
    rotary_dim even and <= head_dim. q and k may be strided views (e.g. of a fused qkv
    output) but need a unit stride on head_dim.
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [num_tokens, heads, head_dim]")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.dtype != k.dtype or not q.dtype.is_floating_point:
        raise ValueError(f"q ({q.dtype}) and k ({k.dtype}) must share a floating dtype")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k need a unit stride on head_dim")
    if positions.shape != (num_tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions must be int32/int64 [{num_tokens}], got {positions.dtype} {tuple(positions.shape)}"
        )
    if not positions.is_contiguous():
        raise ValueError("positions must be contiguous")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must be [max_position, rotary_dim] with a unit last stride")
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
    if len({q.device, k.device, positions.device, cos_sin_cache.device}) != 1:
        raise ValueError("q, k, positions and cos_sin_cache must share a device")
    if num_tokens == 0:
        return

    _rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        **rotary_config(num_heads, num_kv_heads, rotary_dim),
    )


def rotary_config(num_heads: int, num_kv_heads: int, rotary_dim: int) -> dict[str, object]:
    """The constexprs `rotary_embedding` launches `_rotary_kernel` with."""
    half = rotary_dim // 2
    return dict(
        NUM_HEADS=num_heads,
        NUM_HEADS_PADDED=triton.next_power_of_2(num_heads),
        NUM_KV_HEADS=num_kv_heads,
        NUM_KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_PADDED=triton.next_power_of_2(half),
    )
