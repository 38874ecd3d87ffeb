"""Fused mixture-of-experts MLP: every expert's gate_up and down projections in one grouped GEMM launch each.

As vLLM's `fused_moe`. The (token, slot) pairs -- a token's `top_k` routing choices, flattened
to `pair = token * top_k + slot` -- are sorted by expert and each expert's run is padded to
`BLOCK_M` with the sentinel `num_pairs` (`moe_align_block_size`, torch ops, no host sync)::

    topk_ids [[2, 0], [0, 3], [2, 3]]   (3 tokens, top 2; expert 1 gets no token)
    BLOCK_M = 2
    sorted_pair_ids  [1  2 | 0  4 | 3  5 | S  S ...]   S = 6, the padding (and the unused tail)
    block_expert_ids [  0  |   2  |   3  |  ...  ]
    num_padded_pairs 6

Each program owns one block of `BLOCK_M` sorted pairs and `BLOCK_N` output columns; it reads
its expert's weight `w[block_expert_ids[block]]`, gathers the pairs' rows of A (row
`pair // TOP_K`: the token for gate_up, the pair itself for down), accumulates in fp32 and
scatters to the pairs' rows of C. Blocks past `num_padded_pairs` exit at once, so the grid is
the upper bound `cdiv(num_pairs + num_experts * (BLOCK_M - 1), BLOCK_M)`.

    gate_up  [num_pairs, 2I] = x[pair // top_k] @ w_gate_up[e].T
    act      [num_pairs, I]  = silu(gate) * up                     (kernels.activation)
    down     [num_pairs, H]  = (act[pair] @ w_down[e].T) * topk_weights[pair]   (MUL_ROUTED_WEIGHT)
    out      [num_tokens, H] = sum over the top_k slots (fp32, then x's dtype)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernels._interpreter  # noqa: F401  (interpreter fix, when interpreting)
from kernels.activation import silu_and_mul

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_pair_ids, block_expert_ids, num_padded_pairs) for `topk_ids` [num_tokens, top_k].

    `sorted_pair_ids` [max_padded] int32: the pairs grouped by expert (in pair order within
    an expert), each expert's run padded to a multiple of `block_m` with `num_pairs`; the
    tail past `num_padded_pairs` is padding too. `block_expert_ids` [max_padded // block_m]
    int32: the expert of each block (blocks past `num_padded_pairs` name the last expert and are
    never run). `num_padded_pairs` [1] int32. Sizes are upper bounds, so nothing waits on the device.
    """
    device = topk_ids.device
    expert_of_pair = topk_ids.flatten().to(torch.int64)
    num_pairs = expert_of_pair.numel()
    # (not bincount: on CUDA it reads the largest id back to size its output)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, expert_of_pair, torch.ones_like(expert_of_pair))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    max_padded = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    order = torch.argsort(expert_of_pair, stable=True)
    sorted_experts = expert_of_pair[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    sorted_pair_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[(padded_ends - padded_counts)[sorted_experts] + rank_in_expert] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_expert_ids = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pair_ids, block_expert_ids.to(torch.int32), padded_ends[-1:].to(torch.int32)


@triton.jit
def _fused_moe_kernel(
    c_ptr,  # [num_pairs, N]
    a_ptr,  # [num_pairs // TOP_K, K]
    b_ptr,  # [num_experts, N, K]
    topk_weights_ptr,  # [num_pairs] fp32 (MUL_ROUTED_WEIGHT only)
    sorted_pair_ids_ptr,  # [max_padded] int32
    block_expert_ids_ptr,  # [max_padded // BLOCK_M] int32
    num_padded_pairs_ptr,  # [1] int32
    num_pairs,
    N,
    K,
    stride_a_row,
    stride_a_k,
    stride_b_expert,
    stride_b_n,
    stride_b_k,
    stride_c_pair,
    stride_c_n,
    TOP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_pairs_ptr):
        return
    pairs = tl.load(sorted_pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair_mask = pairs < num_pairs
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // TOP_K)[:, None] * stride_a_row + ks[None, :] * stride_a_k
    b_ptrs = b_ptr + expert * stride_b_expert + ks[:, None] * stride_b_k + cols[None, :] * stride_b_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & (ks[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(ks[:, None] < k_left) & col_mask[None, :], other=0.0)
        if DOT_IN_FP32:  # (exact: a product of two 16-bit floats fits fp32's mantissa)
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_a_k
        b_ptrs += BLOCK_K * stride_b_k
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_c_pair + cols[None, :] * stride_c_n
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_mask[:, None] & col_mask[None, :])


def _grouped_gemm(
    c: torch.Tensor,
    a: torch.Tensor,
    w: torch.Tensor,
    alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    topk_weights: torch.Tensor | None,
    config: dict[str, object],
) -> None:
    """c[pair] = a[pair // TOP_K] @ w[expert of pair].T (times the pair's weight if given), one launch."""
    sorted_pair_ids, block_expert_ids, num_padded_pairs = alignment
    num_pairs, n = c.shape
    grid = (block_expert_ids.numel(), triton.cdiv(n, config["BLOCK_N"]))
    _fused_moe_kernel[grid](
        c, a, w, topk_weights if topk_weights is not None else c,
        sorted_pair_ids, block_expert_ids, num_padded_pairs,
        num_pairs, n, a.shape[1],
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        **config,
    )


def _default_block(size: int, largest: int) -> int:
    return max(16, min(largest, triton.next_power_of_2(size)))


def fused_moe_config(
    dtype: torch.dtype,
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    *,
    on_gpu: bool = True,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> tuple[dict[str, object], dict[str, object]]:
    """The constexprs of `fused_moe`'s two `_fused_moe_kernel` launches: (gate_up, down).

    For `num_tokens` rows of `dtype` routed to `top_k` of `num_experts` experts of `hidden` ->
    `intermediate`; `on_gpu` False is the interpreter (dots in fp32); the blocks override the
    defaults, as `fused_moe`'s arguments of those names do.
    """
    # a small batch spreads over the experts in short runs: short blocks waste less padding
    block_m = block_m or (16 if num_tokens * top_k <= 16 * num_experts else 64)
    block_k = block_k or _default_block(min(hidden, intermediate), 64)
    common = dict(
        DOT_IN_FP32=not on_gpu,  # the interpreter cannot multiply bf16 matrices
        # fp32 as torch computes it (no TF32); fp16 / bf16 on the tensor cores
        DOT_PRECISION="ieee" if dtype == torch.float32 or not on_gpu else "tf32",
        BLOCK_M=block_m,
        BLOCK_K=block_k,
    )
    gate_up = dict(TOP_K=top_k, MUL_ROUTED_WEIGHT=False, BLOCK_N=block_n or _default_block(2 * intermediate, 64))
    down = dict(TOP_K=1, MUL_ROUTED_WEIGHT=True, BLOCK_N=block_n or _default_block(hidden, 64))
    return {**gate_up, **common}, {**down, **common}


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """sum_slot topk_weights[t, slot] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, slot].

    x [num_tokens, H]; w_gate_up [E, 2I, H] rows [gate | up]; w_down [E, H, I]; topk_weights
    (any float dtype, used in fp32) and topk_ids (int) [num_tokens, top_k], every id in [0, E)
    (not checked: that would wait on the device). Products accumulate in fp32; the gate_up and
    activation outputs are kept in x's dtype, the weighted down outputs and their sum in fp32;
    the result is in x's dtype. Blocks (powers of two >= 16) default to 16-64 by the shapes.
    """
    if activation != "silu":
        raise ValueError(f"fused_moe: activation must be 'silu', got {activation!r}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(
            f"fused_moe: x must be [num_tokens, hidden] with a unit last stride, got {tuple(x.shape)} {x.stride()}"
        )
    if x.dtype not in _FLOAT_DTYPES or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(
            f"fused_moe: x, w_gate_up, w_down must share one of {_FLOAT_DTYPES}, "
            f"got {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}"
        )
    num_tokens, hidden = x.shape
    if w_gate_up.dim() != 3 or w_gate_up.shape[2] != hidden or w_gate_up.shape[1] % 2:
        raise ValueError(
            f"fused_moe: w_gate_up must be [num_experts, 2 * intermediate, {hidden}], got {tuple(w_gate_up.shape)}"
        )
    num_experts, intermediate = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    if tuple(w_down.shape) != (num_experts, hidden, intermediate):
        raise ValueError(
            f"fused_moe: w_down must be [{num_experts}, {hidden}, {intermediate}], got {tuple(w_down.shape)}"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_ids.dtype.is_floating_point:
        raise ValueError(
            f"fused_moe: topk_ids must be integer [{num_tokens}, top_k], got {topk_ids.dtype} {tuple(topk_ids.shape)}"
        )
    if topk_weights.shape != topk_ids.shape or not topk_weights.dtype.is_floating_point:
        raise ValueError(
            f"fused_moe: topk_weights must be float {tuple(topk_ids.shape)}, "
            f"got {topk_weights.dtype} {tuple(topk_weights.shape)}"
        )
    devices = {t.device for t in (x, w_gate_up, w_down, topk_weights, topk_ids)}
    if len(devices) != 1:
        raise ValueError(f"fused_moe: all tensors must be on one device, got {sorted(map(str, devices))}")
    for name, block in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if block is not None and (block < 16 or block & (block - 1)):
            raise ValueError(f"fused_moe: {name} must be a power of two >= 16, got {block}")
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    gate_up_config, down_config = fused_moe_config(
        x.dtype, num_tokens, num_experts, top_k, hidden, intermediate, on_gpu=x.is_cuda,
        block_m=block_m, block_n=block_n, block_k=block_k,
    )
    alignment = moe_align_block_size(topk_ids, num_experts, gate_up_config["BLOCK_M"])
    gate_up = torch.empty(num_tokens * top_k, 2 * intermediate, dtype=x.dtype, device=x.device)
    _grouped_gemm(gate_up, x, w_gate_up, alignment, None, gate_up_config)
    act = silu_and_mul(gate_up)
    down = torch.empty(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.flatten().to(torch.float32).contiguous()
    _grouped_gemm(down, act, w_down, alignment, weights, down_config)
    return down.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
