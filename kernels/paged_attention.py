"""Unified paged attention: one launch for a flat batch of prefill chunks and decodes.

Each program owns one *query block* of one request and one KV head: `BLOCK_Q` query
tokens times the `NUM_QUERIES_PER_KV` query heads that share that KV head, packed as
`BLOCK_M = BLOCK_Q * QUERIES_PER_KV_PADDED` rows, so GQA reads each K/V tile once per group::

    row r  ->  query token  q_block * BLOCK_Q + r // QUERIES_PER_KV_PADDED   (within the request)
               query head   kv_head * NUM_QUERIES_PER_KV + r % QUERIES_PER_KV_PADDED

Query blocks are numbered without a host sync: request i owns the numbers starting at
`query_start_loc[i] // BLOCK_Q + i` (an upper bound on the blocks before it), so the grid
is `num_tokens // BLOCK_Q + num_seqs` and surplus programs exit at once. A program finds
its request by binary search over `query_start_loc`.

The program walks the request's KV positions in tiles of `TILE_N`; each position's slot is
`block_table[seq, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE`, so a tile may span
several cache blocks. Query row at position `p` sees KV positions `0 .. p` (causal with the
context offset). Softmax is online, in fp32, base 2.

Split-KV (flash-decoding): with `num_segments > 1` the third grid axis cuts each request's
tiles into `num_segments` ranges; every program writes its unnormalised partial output,
running max and sum, and `_reduce_segments_kernel` merges them. The launcher picks it for
decode-only batches whose few (sequence, KV head) pairs would leave the GPU idle.

FP8 cache (float8_e4m3fn or float8_e5m2): values are dequantised on load, `k_scale` folded
into the softmax scale and `v_scale` into the output. Triton converts e4m3 on CUDA from compute
capability 8.9 (and on ROCm), e5m2 from 8.0.

`paged_attention_config` is the launcher's whole tuning choice (tiles, split, warps) as the
kernel's keyword arguments, so `bench/kernel_compile_table.py` compiles what it launches.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

import kernels._interpreter  # noqa: F401  (interpreter fix, when interpreting)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_MAX_SEGMENTS = 64
_MIN_TILES_PER_SEGMENT = 4


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The last request i whose first query block `query_start_loc[i] // BLOCK_Q + i` is <= q_block_idx."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    segm_acc_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_DIM_PADDED] fp32 (split-KV only)
    segm_max_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] fp32 (split-KV only)
    segm_sum_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] fp32 (split-KV only)
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    block_table_ptr,  # [num_seqs, max_num_blocks] int32
    qk_scale,  # softmax scale * k_scale * log2(e)
    v_scale,
    num_seqs,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_k_cache_block,
    stride_k_cache_slot,
    stride_k_cache_head,
    stride_v_cache_block,
    stride_v_cache_slot,
    stride_v_cache_head,
    stride_block_table_seq,
    stride_segm_acc_token,
    stride_segm_acc_head,
    stride_segm_acc_segment,
    stride_segm_max_token,
    stride_segm_max_head,
    NUM_QUERIES_PER_KV: tl.constexpr,
    QUERIES_PER_KV_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    KV_IS_FP8: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq_idx = _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    query_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    q_block_local = q_block_idx - (q_start // BLOCK_Q + seq_idx)
    if q_block_local * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    q_local = q_block_local * BLOCK_Q + rows // QUERIES_PER_KV_PADDED
    head_in_group = rows % QUERIES_PER_KV_PADDED
    head = kv_head * NUM_QUERIES_PER_KV + head_in_group
    row_valid = (q_local < query_len) & (head_in_group < NUM_QUERIES_PER_KV)
    token = (q_start + q_local).to(tl.int64)
    q_pos = context_len + q_local

    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # KV positions this block can see, and this segment's share of their tiles.
    kv_len = tl.minimum(context_len + (q_block_local + 1) * BLOCK_Q, seq_len)
    num_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_segment = tl.cdiv(tl.cdiv(seq_len, TILE_N), NUM_SEGMENTS)
    tile_lo = segment * tiles_per_segment
    tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    block_table_row = block_table_ptr + seq_idx.to(tl.int64) * stride_block_table_seq

    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + tl.arange(0, TILE_N)
        pos_valid = pos < kv_len
        block_id = tl.load(block_table_row + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        slot_in_block = pos % BLOCK_SIZE
        kv_mask = pos_valid[None, :] & dim_valid[:, None]

        k = tl.load(  # [HEAD_DIM_PADDED, TILE_N]
            k_cache_ptr
            + block_id[None, :] * stride_k_cache_block
            + slot_in_block[None, :] * stride_k_cache_slot
            + kv_head * stride_k_cache_head
            + dims[:, None],
            mask=kv_mask,
            other=0.0,
        )
        if KV_IS_FP8:
            k = k.to(tl.float32)
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        visible = (pos[None, :] <= q_pos[:, None]) & pos_valid[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, 1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - m_base[:, None])
        alpha = tl.exp2(m - m_base)
        l = l * alpha + tl.sum(p, 1)
        m = m_new

        v = tl.load(  # [TILE_N, HEAD_DIM_PADDED]
            v_cache_ptr
            + block_id[:, None] * stride_v_cache_block
            + slot_in_block[:, None] * stride_v_cache_slot
            + kv_head * stride_v_cache_head
            + dims[None, :],
            mask=pos_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if KV_IS_FP8:
            v = v.to(tl.float32)
        # P is rounded to the query dtype, as the tensor cores see it on the GPU.
        p = p.to(q_ptr.dtype.element_ty).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(q.dtype), input_precision=DOT_PRECISION)

    if NUM_SEGMENTS == 1:
        l = tl.where(l == 0.0, 1.0, l)
        o = acc * (v_scale / l)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        tl.store(
            segm_acc_ptr
            + token[:, None] * stride_segm_acc_token
            + head[:, None] * stride_segm_acc_head
            + segment * stride_segm_acc_segment
            + dims[None, :],
            acc * v_scale,
            mask=row_valid[:, None],
        )
        stat_offs = token * stride_segm_max_token + head * stride_segm_max_head + segment
        tl.store(segm_max_ptr + stat_offs, m, mask=row_valid)
        tl.store(segm_sum_ptr + stat_offs, l, mask=row_valid)


@triton.jit
def _reduce_segments_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    segm_acc_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_DIM_PADDED]
    segm_max_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS]
    segm_sum_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS]
    stride_out_token,
    stride_out_head,
    stride_segm_acc_token,
    stride_segm_acc_head,
    stride_segm_acc_segment,
    stride_segm_max_token,
    stride_segm_max_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    segments = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_DIM_PADDED)

    stat_offs = token * stride_segm_max_token + head * stride_segm_max_head + segments
    seg_max = tl.load(segm_max_ptr + stat_offs)
    seg_sum = tl.load(segm_sum_ptr + stat_offs)
    # Every row sees position 0, so at least one segment has a finite max.
    weight = tl.exp2(seg_max - tl.max(seg_max, 0))
    total = tl.sum(seg_sum * weight, 0)
    seg_acc = tl.load(
        segm_acc_ptr
        + token * stride_segm_acc_token
        + head * stride_segm_acc_head
        + segments[:, None] * stride_segm_acc_segment
        + dims[None, :]
    )
    o = tl.sum(seg_acc * weight[:, None], 0) / total
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        o.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def choose_num_segments(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, tile_n: int, num_sms: int
) -> int:
    """How many KV segments per request: > 1 only for decode-only batches too small to fill the GPU.

    Aims at about 4 programs per SM, keeps at least 4 tiles per segment, and returns a power of 2.
    """
    num_programs = num_seqs * num_kv_heads
    target = 4 * num_sms
    if max_query_len != 1 or num_programs == 0 or num_programs * 2 > target:
        return 1
    wanted = min(target // num_programs, max_seq_len // (_MIN_TILES_PER_SEGMENT * tile_n), _MAX_SEGMENTS)
    return 1 if wanted < 2 else 1 << (wanted.bit_length() - 1)


def paged_attention_config(
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_seqs: int,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int,
    *,
    max_shared: int | None = None,
    on_gpu: bool = True,
    num_segments: int | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
) -> dict[str, object]:
    """The keyword arguments `paged_attention` launches `_paged_attention_kernel` with: constexprs and num_warps.

    Queries in `dtype`, the cache in `kv_cache_dtype`; `num_sms` (0: not a GPU) sizes the split-KV
    choice; `max_shared`: the GPU's shared memory per block in bytes (None: no limit), which the
    tiles are shrunk to fit; `on_gpu` False is the interpreter (dots in fp32). `num_segments`,
    `tile_n` and `num_warps` override the defaults, as the launcher's arguments of those names do.
    """
    queries_per_kv_padded = triton.next_power_of_2(num_heads // num_kv_heads)
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    block_m = max(16 if max_query_len <= 16 else 64, queries_per_kv_padded)
    tile_n_given = tile_n is not None
    if tile_n is None:
        tile_n = 64 if max_query_len == 1 else 32
    if tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n must be a power of 2 >= 16, got {tile_n}")
    operand_bytes = dtype.itemsize  # K and V are converted to q's dtype before the dots
    while max_shared is not None and _shared_bytes(block_m, tile_n, head_dim_padded, operand_bytes) > max_shared:
        if tile_n > 16 and not tile_n_given:
            tile_n //= 2
        elif block_m > max(16, queries_per_kv_padded):
            block_m //= 2
        else:
            break
    if num_segments is None:
        num_segments = choose_num_segments(num_seqs, num_kv_heads, max_query_len, max_seq_len, tile_n, num_sms)
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of 2 >= 1, got {num_segments}")
    return dict(
        NUM_QUERIES_PER_KV=num_heads // num_kv_heads,
        QUERIES_PER_KV_PADDED=queries_per_kv_padded,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_m // queries_per_kv_padded,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        NUM_SEGMENTS=num_segments,
        KV_IS_FP8=kv_cache_dtype in FP8_DTYPES,
        DOT_IN_FP32=not on_gpu,  # the interpreter cannot multiply bf16 matrices
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=num_warps or 4,
    )


def _shared_bytes(block_m: int, tile_n: int, head_dim_padded: int, operand_bytes: int) -> int:
    """An upper bound on the kernel's shared memory: the dot operands Q, K, V and P staged at once, plus
    scratch. Against bench/kernel_compile_table.py at head dim 256, BLOCK_M 64, TILE_N 32 (this: fp32
    140,288 B, bf16 70,656 B): fp32 139,776 B on sm_80 / sm_89 / sm_90, 73,728 on gfx942; bf16
    49,152-53,248 on CUDA, 32,768 on gfx942."""
    return operand_bytes * (block_m * head_dim_padded + 2 * tile_n * head_dim_padded + block_m * tile_n) + 1024


def reduce_segments_config(attention_config: dict[str, object]) -> dict[str, object]:
    """The keyword arguments of `_reduce_segments_kernel` after an attention launch with `attention_config`."""
    return {name: attention_config[name] for name in ("HEAD_DIM", "HEAD_DIM_PADDED", "NUM_SEGMENTS")}


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    num_segments: int | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Causal attention of every query row over its request's cached K/V, into `out` (returned).

    `q` [num_tokens, num_heads, head_dim]; `k_cache`, `v_cache` [num_blocks, block_size,
    num_kv_heads, head_dim] in q's dtype or an FP8 dtype (float8_e4m3fn, float8_e5m2: then
    `k_scale`, `v_scale` dequantise); `query_start_loc` [num_seqs + 1], `seq_lens` [num_seqs] and `block_table`
    [num_seqs, max_num_blocks] int32 as in `executor_svc.attention.base`. The new tokens' K/V
    must already be in the cache. `max_query_len` and `max_seq_len` are host-side bounds that
    pick the tiling and the split. `num_segments` (a power of 2) forces the split-KV path;
    `tile_n` and `num_warps` override the tuning defaults.
    """
    _check_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with a unit last stride")
    if num_tokens == 0 or num_seqs == 0:
        return out

    gpu = torch.cuda.get_device_properties(q.device) if q.is_cuda else None
    config = paged_attention_config(
        q.dtype, k_cache.dtype, num_heads, num_kv_heads, head_dim, block_size, num_seqs, max_query_len, max_seq_len,
        gpu.multi_processor_count if gpu else 0, max_shared=gpu.shared_memory_per_block_optin if gpu else None,
        on_gpu=q.is_cuda, num_segments=num_segments, tile_n=tile_n, num_warps=num_warps,
    )
    num_segments, block_q, head_dim_padded = config["NUM_SEGMENTS"], config["BLOCK_Q"], config["HEAD_DIM_PADDED"]

    if num_segments > 1:
        segm_acc = torch.empty(
            num_tokens, num_heads, num_segments, head_dim_padded, dtype=torch.float32, device=q.device
        )
        segm_max = torch.empty(num_tokens, num_heads, num_segments, dtype=torch.float32, device=q.device)
        segm_sum = torch.empty_like(segm_max)
        segm_acc_strides = segm_acc.stride()[:3]
        segm_max_strides = segm_max.stride()[:2]
    else:
        segm_acc = segm_max = segm_sum = out  # never touched
        segm_acc_strides, segm_max_strides = (0, 0, 0), (0, 0)

    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    _paged_attention_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        segm_acc,
        segm_max,
        segm_sum,
        query_start_loc,
        seq_lens,
        block_table,
        scale * k_scale * math.log2(math.e),
        v_scale,
        num_seqs,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        *segm_acc_strides,
        *segm_max_strides,
        **config,
    )
    if num_segments > 1:
        _reduce_segments_kernel[(num_tokens, num_heads)](
            out,
            segm_acc,
            segm_max,
            segm_sum,
            out.stride(0),
            out.stride(1),
            *segm_acc_strides,
            *segm_max_strides,
            **reduce_segments_config(config),
        )
    return out


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be 3-D and k_cache 4-D, got {tuple(q.shape)} and {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match k_cache {tuple(k_cache.shape)} {k_cache.dtype}"
        )
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and k_cache ({k_cache.shape[3]}) differ")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not one of {_FLOAT_DTYPES}")
    kv_is_fp8 = k_cache.dtype in FP8_DTYPES
    if k_cache.dtype != q.dtype and not kv_is_fp8:
        raise ValueError(f"k_cache dtype {k_cache.dtype} must be q's ({q.dtype}) or one of {FP8_DTYPES}")
    if not kv_is_fp8 and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError("k_scale and v_scale apply to an fp8 cache (float8_e4m3fn, float8_e5m2) only")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache need a unit stride on head_dim")
    num_seqs = seq_lens.shape[0]
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_table", block_table)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if query_start_loc.shape != (num_seqs + 1,) or not query_start_loc.is_contiguous() or not seq_lens.is_contiguous():
        raise ValueError(f"query_start_loc must be contiguous [{num_seqs + 1}] and seq_lens contiguous [{num_seqs}]")
    if block_table.dim() != 2 or block_table.shape[0] != num_seqs or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be [{num_seqs}, max_num_blocks] with a unit last stride")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(f"caches on {k_cache.device}/{v_cache.device}, q on {q.device}")
