"""Multi-LoRA shrink and expand (SGMV): every adapter of a step in one launch each, rows grouped by slot.

As vLLM's punica Triton ops. A step's rows each name an adapter slot (`token_lora`, -1 = the
base model only). `lora_metadata` groups the rows by slot once per step; every LoRA linear of
the step shares it::

    token_lora       [ 2  -1   0   2   0  -1   2 ]    (7 rows, slots 0 and 2; slot 1 loaded, unused)
    sorted_token_ids [ 1   5 | 2   4 | 0   3   6 ]    (base rows first, then by slot, rows ascending)
    slot_ids                 [ 0     | 2         ]
    num_tokens_per_slot      [ 2     | 3         ]
    slot_start_loc           [ 2     | 4         ]

    lora_shrink   y[t]                        = scale * x[t] @ a[slot(t)].T     [T, R] fp32, 0 on base rows
    lora_expand   out[t, offset:offset + N]  (+)= y[t] @ b[slot(t)].T           base rows untouched

`a` [L, R, K] and `b` [L, N, R] stack the L loaded slots' weights, each rank zero-padded to R.
A program owns `BLOCK_M` rows of one slot (grid axis 2 = index into `slot_ids`, axis 1 = row
block of that slot's run, sized by the longest run; blocks past a slot's run exit at once) and
one block of output columns. It gathers its rows through `sorted_token_ids`, reads its slot's
weight tile, accumulates in fp32 and scatters back to the same rows. Shrink's K (the hidden
size) is long and its output (the rank) narrow, so K is also split over `SPLIT_K` programs that
`atomic_add` into the zeroed fp32 output (sums in an order that may vary run to run on a GPU);
expand's K is the rank, one or two blocks.

Merged projections (q/k/v stacked in one output, gate/up): shrink once with the slices' A
stacked along the rank ([L, S * R, K]), then expand each slice from its column view of y into
its columns of the merged output with `out_offset`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

import kernels._interpreter  # noqa: F401  (interpreter fix, when interpreting)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class LoraMeta:
    """One step's rows grouped by adapter slot (module docstring's picture); tensors on the mapping's device.

    `sorted_token_ids` [T] int32: every row, base rows (-1) first, then slot by slot ascending,
    rows ascending within a slot. `slot_ids`, `num_tokens_per_slot`, `slot_start_loc` [S] int32:
    the S slots present (never -1), their row counts and where their runs start in
    `sorted_token_ids`. The ints size grids and check slots without reading the device.
    """

    token_lora: torch.Tensor
    sorted_token_ids: torch.Tensor
    slot_ids: torch.Tensor
    num_tokens_per_slot: torch.Tensor
    slot_start_loc: torch.Tensor
    num_tokens: int
    max_tokens_per_slot: int  # the longest run; 0 when no row has an adapter
    max_slot_id: int  # -1 when no row has an adapter

    @property
    def num_slots(self) -> int:
        return self.slot_ids.numel()


def lora_metadata(token_lora: torch.Tensor) -> LoraMeta:
    """Group the rows of a step by adapter slot. `token_lora` [T] int32 or int64, -1 = no adapter.

    Computed on the host (one copy of T ints from the device when the mapping lives there), the
    results moved to the mapping's device; once per step, shared by every LoRA linear.
    """
    if token_lora.dim() != 1 or token_lora.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"lora_metadata: token_lora must be int32 or int64 [num_tokens], "
            f"got {token_lora.dtype} {tuple(token_lora.shape)}"
        )
    host = token_lora.cpu().to(torch.int64)
    if host.numel() and int(host.min()) < -1:
        raise ValueError(f"lora_metadata: token_lora must be >= -1 (no adapter), got {int(host.min())}")
    order = torch.argsort(host, stable=True)
    slot_ids, counts = torch.unique_consecutive(host[order], return_counts=True)
    starts = counts.cumsum(0) - counts
    present = slot_ids >= 0
    slot_ids, counts, starts = slot_ids[present], counts[present], starts[present]
    device = token_lora.device
    return LoraMeta(
        token_lora=token_lora,
        sorted_token_ids=order.to(device=device, dtype=torch.int32),
        slot_ids=slot_ids.to(device=device, dtype=torch.int32),
        num_tokens_per_slot=counts.to(device=device, dtype=torch.int32),
        slot_start_loc=starts.to(device=device, dtype=torch.int32),
        num_tokens=host.numel(),
        max_tokens_per_slot=int(counts.max()) if counts.numel() else 0,
        max_slot_id=int(slot_ids.max()) if slot_ids.numel() else -1,
    )


def _pow2_block(size: int, smallest: int, largest: int) -> int:
    return max(smallest, min(largest, triton.next_power_of_2(max(size, 1))))


def lora_config(kind: str, num_tokens: int, k: int, n: int, rank: int, itemsize: int = 2) -> dict[str, int]:
    """Block sizes and launch options (not tuned on a GPU yet); the launchers pass the longest
    slot run (`meta.max_tokens_per_slot`) as `num_tokens`, the rows one slot's programs cover.

    kind "shrink": x [num_tokens, k] -> [num_tokens, rank] (`n` unused); keys BLOCK_M, BLOCK_N
    (over the rank), BLOCK_K, SPLIT_K, num_warps, num_stages. kind "expand": y [num_tokens,
    rank] -> [num_tokens, n] (`k` unused); keys BLOCK_M, BLOCK_N, BLOCK_K (over the rank),
    num_warps, num_stages. Blocks are powers of two >= 16 (tl.dot's least). `itemsize`: bytes of an
    element of x (4: float32, whose long K blocks are halved to fit 64 KB of shared memory on MI300X).
    """
    block_m = _pow2_block(num_tokens, 16, 64)
    if kind == "shrink":
        # decode: few rows, the adapters' A dominate the reads: long K blocks, spread over programs
        block_k = _pow2_block(k, 16, (256 if num_tokens <= 64 else 64) * 2 // max(itemsize, 2))
        split_k = min(triton.cdiv(k, block_k), 64 if num_tokens <= 64 else 8)
        return dict(BLOCK_M=block_m, BLOCK_N=_pow2_block(rank, 16, 64), BLOCK_K=block_k, SPLIT_K=split_k,
                    num_warps=4, num_stages=2)
    if kind == "expand":
        return dict(BLOCK_M=block_m, BLOCK_N=_pow2_block(n, 16, 128), BLOCK_K=_pow2_block(rank, 16, 64),
                    num_warps=4, num_stages=2)
    raise ValueError(f"lora_config: kind must be 'shrink' or 'expand', got {kind!r}")


@triton.jit
def _lora_shrink_kernel(
    out_ptr,  # [T, R] fp32, zeroed
    x_ptr,  # [T, K]
    a_ptr,  # [L, R, K]
    sorted_token_ids_ptr,  # [T] int32
    slot_ids_ptr,  # [S] int32
    num_tokens_per_slot_ptr,  # [S] int32
    slot_start_loc_ptr,  # [S] int32
    K,
    R,
    scale,
    stride_x_token,
    stride_x_k,
    stride_a_slot,
    stride_a_rank,
    stride_a_k,
    stride_out_token,
    stride_out_rank,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0) // SPLIT_K
    pid_sk = tl.program_id(0) % SPLIT_K
    pid_m = tl.program_id(1)
    slot_index = tl.program_id(2)
    num_tokens = tl.load(num_tokens_per_slot_ptr + slot_index)
    if pid_m * BLOCK_M >= num_tokens:
        return
    slot = tl.load(slot_ids_ptr + slot_index).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < num_tokens
    start = tl.load(slot_start_loc_ptr + slot_index)
    rows = tl.load(sorted_token_ids_ptr + start + offs_m, mask=row_mask, other=0).to(tl.int64)
    ranks = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rank_mask = ranks < R
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_x_token + (pid_sk * BLOCK_K + ks)[None, :] * stride_x_k
    a_ptrs = (a_ptr + slot * stride_a_slot + ranks[None, :] * stride_a_rank
              + (pid_sk * BLOCK_K + ks)[:, None] * stride_a_k)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K * SPLIT_K)):
        k_left = K - (k * SPLIT_K + pid_sk) * BLOCK_K
        x = tl.load(x_ptrs, mask=row_mask[:, None] & (ks[None, :] < k_left), other=0.0)
        a = tl.load(a_ptrs, mask=(ks[:, None] < k_left) & rank_mask[None, :], other=0.0)
        if DOT_IN_FP32:  # (exact: a product of two 16-bit floats fits fp32's mantissa)
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * SPLIT_K * stride_x_k
        a_ptrs += BLOCK_K * SPLIT_K * stride_a_k
    acc *= scale
    out_ptrs = out_ptr + rows[:, None] * stride_out_token + ranks[None, :] * stride_out_rank
    mask = row_mask[:, None] & rank_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")


@triton.jit
def _lora_expand_kernel(
    out_ptr,  # [T, >= out_offset + N]
    y_ptr,  # [T, R]
    b_ptr,  # [L, N, R]
    sorted_token_ids_ptr,  # [T] int32
    slot_ids_ptr,  # [S] int32
    num_tokens_per_slot_ptr,  # [S] int32
    slot_start_loc_ptr,  # [S] int32
    N,
    R,
    out_offset,
    stride_y_token,
    stride_y_rank,
    stride_b_slot,
    stride_b_n,
    stride_b_rank,
    stride_out_token,
    stride_out_n,
    ADD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    slot_index = tl.program_id(2)
    num_tokens = tl.load(num_tokens_per_slot_ptr + slot_index)
    if pid_m * BLOCK_M >= num_tokens:
        return
    slot = tl.load(slot_ids_ptr + slot_index).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < num_tokens
    start = tl.load(slot_start_loc_ptr + slot_index)
    rows = tl.load(sorted_token_ids_ptr + start + offs_m, mask=row_mask, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    y_ptrs = y_ptr + rows[:, None] * stride_y_token + ks[None, :] * stride_y_rank
    b_ptrs = b_ptr + slot * stride_b_slot + cols[None, :] * stride_b_n + ks[:, None] * stride_b_rank
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(R, BLOCK_K)):
        k_left = R - k * BLOCK_K
        # y stays fp32 (shrink's output); b's 16-bit values are exact in fp32 and in tf32
        y = tl.load(y_ptrs, mask=row_mask[:, None] & (ks[None, :] < k_left), other=0.0).to(tl.float32)
        b = tl.load(b_ptrs, mask=(ks[:, None] < k_left) & col_mask[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(y, b, acc, input_precision=DOT_PRECISION)
        y_ptrs += BLOCK_K * stride_y_rank
        b_ptrs += BLOCK_K * stride_b_rank
    out_ptrs = out_ptr + rows[:, None] * stride_out_token + (out_offset + cols)[None, :] * stride_out_n
    mask = row_mask[:, None] & col_mask[None, :]
    if ADD:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _checked_config(name: str, kind: str, default: dict[str, int], config: dict[str, int] | None) -> dict[str, int]:
    if config is None:
        return default
    unknown = set(config) - set(default)
    if unknown:
        raise ValueError(f"{name}: config keys must be among {sorted(default)}, got {sorted(unknown)}")
    merged = default | config
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        block = merged[key]
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name}: config.{key} must be a power of two >= 16, got {block}")
    if kind == "shrink" and merged["SPLIT_K"] < 1:
        raise ValueError(f"{name}: config.SPLIT_K must be >= 1, got {merged['SPLIT_K']}")
    return merged


def _check_meta(name: str, meta: LoraMeta, num_tokens: int, num_slots: int, device: torch.device) -> None:
    if meta.num_tokens != num_tokens:
        raise ValueError(f"{name}: meta is for {meta.num_tokens} tokens, the input has {num_tokens}")
    if meta.max_slot_id >= num_slots:
        raise ValueError(f"{name}: meta names slot {meta.max_slot_id}, the weights stack {num_slots} slots")
    if meta.sorted_token_ids.device != device:
        raise ValueError(f"{name}: meta is on {meta.sorted_token_ids.device}, the tensors on {device}")


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    meta: LoraMeta,
    scale: float = 1.0,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """scale * x[t] @ a[slot(t)].T for every row t with an adapter; [T, R] float32, zeros on base rows.

    x [T, K] and a [L, R, K] share one of float32, float16, bfloat16; products accumulate in
    fp32. `config` overrides `lora_config("shrink", ...)`'s entries.
    """
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"lora_shrink: x must be [num_tokens, K] of {_FLOAT_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    num_tokens, k = x.shape
    if a.dim() != 3 or a.shape[2] != k or a.dtype != x.dtype:
        raise ValueError(
            f"lora_shrink: a must be [num_slots, rank, {k}] of {x.dtype}, got {a.dtype} {tuple(a.shape)}"
        )
    if a.device != x.device:
        raise ValueError(f"lora_shrink: x and a must be on one device, got {x.device} and {a.device}")
    _check_meta("lora_shrink", meta, num_tokens, a.shape[0], x.device)
    rank = a.shape[1]
    default = lora_config("shrink", meta.max_tokens_per_slot, k, 0, rank, x.element_size())
    cfg = _checked_config("lora_shrink", "shrink", default, config)
    out = torch.zeros(num_tokens, rank, dtype=torch.float32, device=x.device)
    if meta.num_slots == 0 or rank == 0:
        return out
    num_row_blocks = triton.cdiv(meta.max_tokens_per_slot, cfg["BLOCK_M"])
    grid = (triton.cdiv(rank, cfg["BLOCK_N"]) * cfg["SPLIT_K"], num_row_blocks, meta.num_slots)
    _lora_shrink_kernel[grid](
        out, x, a, meta.sorted_token_ids, meta.slot_ids, meta.num_tokens_per_slot, meta.slot_start_loc,
        k, rank, float(scale),
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), out.stride(0), out.stride(1),
        DOT_IN_FP32=not x.is_cuda,  # the interpreter cannot multiply bf16 matrices
        # fp32 as torch computes it (no TF32); fp16 / bf16 on the tensor cores
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or not x.is_cuda else "tf32",
        **cfg,
    )
    return out


def lora_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    meta: LoraMeta,
    out: torch.Tensor,
    add: bool = True,
    out_offset: int = 0,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """out[t, out_offset:out_offset + N] (+)= y[t] @ b[slot(t)].T for every row t with an adapter.

    y [T, R] (any float dtype, read as fp32; a column view of a stacked shrink is fine); b [L, N,
    R] and out [T, >= out_offset + N] share one of float32, float16, bfloat16. Accumulates in
    fp32 (with out's old value when `add`), rounds once to out's dtype; base rows and the other
    columns are left untouched. Returns out. `config` overrides `lora_config("expand", ...)`'s.
    """
    if y.dim() != 2 or not y.dtype.is_floating_point:
        raise ValueError(f"lora_expand: y must be float [num_tokens, rank], got {y.dtype} {tuple(y.shape)}")
    num_tokens, rank = y.shape
    if b.dim() != 3 or b.shape[2] != rank or b.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"lora_expand: b must be [num_slots, N, {rank}] of {_FLOAT_DTYPES}, got {b.dtype} {tuple(b.shape)}"
        )
    n = b.shape[1]
    if out.dim() != 2 or out.shape[0] != num_tokens or out.dtype != b.dtype:
        raise ValueError(
            f"lora_expand: out must be [{num_tokens}, columns] of {b.dtype}, got {out.dtype} {tuple(out.shape)}"
        )
    if out_offset < 0 or out_offset + n > out.shape[1]:
        raise ValueError(
            f"lora_expand: out_offset + N must be within out's {out.shape[1]} columns, got {out_offset} + {n}"
        )
    if len({y.device, b.device, out.device}) != 1:
        raise ValueError(f"lora_expand: y, b, out must be on one device, got {y.device}, {b.device}, {out.device}")
    _check_meta("lora_expand", meta, num_tokens, b.shape[0], out.device)
    default = lora_config("expand", meta.max_tokens_per_slot, 0, n, rank)
    cfg = _checked_config("lora_expand", "expand", default, config)
    if meta.num_slots == 0 or n == 0:
        return out
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(meta.max_tokens_per_slot, cfg["BLOCK_M"]), meta.num_slots)
    _lora_expand_kernel[grid](
        out, y, b, meta.sorted_token_ids, meta.slot_ids, meta.num_tokens_per_slot, meta.slot_start_loc,
        n, rank, out_offset,
        y.stride(0), y.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        ADD=add,
        # fp32 weights as torch computes them; 16-bit weights on the tensor cores as tf32 (y rounded to 10 bits)
        DOT_PRECISION="ieee" if b.dtype == torch.float32 or not out.is_cuda else "tf32",
        **cfg,
    )
    return out


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, token_lora: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """`lora_shrink` in plain torch: one float64 matmul per slot present; [T, R] float32."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64, device=x.device)
    for slot in torch.unique(token_lora).tolist():
        if slot >= 0:
            rows = token_lora == slot
            out[rows] = scale * (x[rows].double() @ a[slot].double().T)
    return out.float()


def lora_expand_ref(
    y: torch.Tensor,
    b: torch.Tensor,
    token_lora: torch.Tensor,
    out: torch.Tensor,
    add: bool = True,
    out_offset: int = 0,
) -> torch.Tensor:
    """`lora_expand` in plain torch: one float64 matmul per slot present, in place on out; returns out."""
    columns = slice(out_offset, out_offset + b.shape[1])
    for slot in torch.unique(token_lora).tolist():
        if slot >= 0:
            rows = token_lora == slot
            delta = y[rows].double() @ b[slot].double().T
            if add:
                delta += out[rows, columns].double()
            out[rows, columns] = delta.to(out.dtype)
    return out
