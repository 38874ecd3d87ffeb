"""`torch`: the portable attention backend (default on the CPU), built on scaled_dot_product_attention.

No Python loop over sequences in the common case. Once per step (the first layer to see a
new `AttentionMetadata`) the backend derives a `_StepLayout`, reused by every layer, that
splits the sequences into groups, each attended in one call:

  * decodes (query length 1) on a CPU with a float32 or bfloat16 cache: all of them in one call of the
    C kernel of `cpu_decode`, which reads K and V in place through the block table (no
    gathered copy, no padding). Elsewhere, or where the kernel cannot be built, SDPA:

  * decodes (query length 1), sorted by length and cut into length buckets (see
    `_length_buckets`) so that a short sequence is not padded to the longest one in the
    batch. The g = H / KVH query heads that share a KV head become g query rows, so GQA
    needs no K/V repeat:

        q [S, KVH, g, D]  x  K [S, KVH, L, D]      mask [S, 1, 1, L]:  key j < seq_len

  * a prefill chunk of at least `LONG_QUERY` tokens, alone: a whole prompt (or its first
    chunk) is plain causal attention on this step's k and v (no gather, no mask); a later
    chunk attends its gathered context with the causal mask offset by the context length.

  * the remaining short queries together, padded to the longest one (SDPA's enable_gqa):

        q [S, H, Q, D]  x  K [S, KVH, L, D]        mask [S, 1, Q, L]:
              key j <= context_len + query row   (padded rows see key 0 only)

K and V are gathered from the paged cache a whole block at a time through the block
table (`index_select` of block rows), L = blocks needed by the group's longest sequence x
block_size. On the CPU decode attention is memory-bound, so the bytes gathered and read
are what the buckets save: for 64 decodes of 32..544 tokens one padded call reads 1.8x the
K/V a bucketed layout does; the kernel reads each byte once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from executor_svc.attention import windowed
from executor_svc.attention.base import AttentionMetadata


@dataclass
class _Group:
    """Sequences attended in one SDPA call."""

    token_rows: torch.Tensor | slice  # rows of q / output, in the group's order
    block_table: torch.Tensor  # [S, num_blocks] block ids (int32 for the decode kernel)
    mask: torch.Tensor | None  # bool: [S, 1, 1, L] for decodes, [S, 1, Q, L] for longer queries
    query_len: int  # Q: 1 for decodes, else the padded length
    pad_index: torch.Tensor | None  # [S, Q] token row per padded query (None for decodes)
    valid: torch.Tensor | None  # [S, Q] bool: a real query row
    causal_self: bool = False  # a single sequence without context: plain causal attention on k, v
    # decodes through the CPU kernel: int32 block table and lengths, and its per-thread split
    kernel_lens: torch.Tensor | None = None
    kernel_split: list[int] | None = None


@dataclass
class _StepLayout:
    write_rows: torch.Tensor | None  # token rows with a slot (None = every row)
    write_slots: torch.Tensor  # [num_written] int64
    groups: list[_Group]


class TorchBackend:
    name = "torch"

    def __init__(self, device: torch.device | str | None = None, decode_kernel: bool | None = None) -> None:
        """`decode_kernel`: decodes on a CPU through `cpu_decode` (None: where it builds; False: SDPA)."""
        self.device = torch.device(device) if device is not None else None
        self._layout_meta: AttentionMetadata | None = None
        self._layout: _StepLayout | None = None
        self._kernel = None
        on_cpu = self.device is None or self.device.type == "cpu"
        if on_cpu and decode_kernel is not False:
            from executor_svc.attention.cpu_decode import CpuDecodeKernel

            self._kernel = CpuDecodeKernel.load()
            if decode_kernel and self._kernel is None:
                raise RuntimeError("the CPU decode attention kernel was asked for and could not be built")

    @property
    def uses_decode_kernel(self) -> bool:
        return self._kernel is not None

    @property
    def decode_kernel(self):
        """The CPU decode-attention kernel (`cpu_decode.CpuDecodeKernel`) decodes go through, or None (SDPA)."""
        return self._kernel

    def step_layout(self, meta: AttentionMetadata, block_size: int) -> _StepLayout:
        """The step's layout as this backend's decode kernel runs it (cached per step): the sequences'
        groups with their block tables, kernel lengths and thread split, and the K/V write slots --
        for callers that run a whole step in C (`executor_svc.cpu_decode_path`)."""
        return self._layout_for(meta, block_size, self._kernel)

    def decode_arguments(self, meta: AttentionMetadata, block_size: int):
        """(write slots, block table, lengths) of a decode-only step whose tensors are already the
        decode kernel's (int64 slots, all written; int32 table and lengths), or None: `step_layout`'s
        one group without its objects, for a caller that runs the step in C on the kernel's OpenMP
        entry (no thread split to compute). A few microseconds a KV cache group instead of ~10,
        out of a step's cold cache."""
        slots, table, lens = meta.slot_mapping, meta.block_table, meta.seq_lens
        if (
            meta.max_query_len != 1 or slots.dtype != torch.int64 or table.dtype != torch.int32
            or lens.dtype != torch.int32 or slots.shape[0] != lens.shape[0] or not slots.is_contiguous()
            or table.stride(1) != 1 or not lens.is_contiguous() or slots.device.type != "cpu"
        ):
            return None
        cols = -(-meta.max_seq_len // block_size)
        if table.shape[1] < cols or int(slots.min()) < 0:
            return None
        return slots, table if table.shape[1] == cols else table[:, :cols], lens

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """`sliding_window` / `logits_soft_cap`: such a layer goes through `windowed.attend`, but a
        window that holds every sequence's whole context (no key falls out of it, so no block
        has been freed) is full attention, on the fast path, and a decode-only step of a sliding
        layer without a cap goes through the decode kernel, which reads the window's keys only."""
        if sliding_window is not None and meta.max_seq_len <= sliding_window:
            sliding_window = None
        kernel = (
            self._kernel
            if k_cache.dtype == q.dtype and q.dtype in (torch.float32, torch.bfloat16) and k_cache.device.type == "cpu"
            else None
        )
        # a decode-only step is one group of the kernel's, which reads a window itself
        kernel_reads_window = kernel is not None and meta.max_query_len == 1
        if logits_soft_cap is not None or (sliding_window is not None and not kernel_reads_window):
            self._write_kv(k, v, k_cache, v_cache, _write_only_layout(meta))
            return windowed.attend(q, k_cache, v_cache, meta, scale, sliding_window, logits_soft_cap)
        layout = self._layout_for(meta, k_cache.shape[1], kernel)
        self._write_kv(k, v, k_cache, v_cache, layout)

        groups = layout.groups
        if len(groups) == 1 and isinstance(groups[0].token_rows, slice):  # the whole batch in one call
            return self._attend(groups[0], q, k, v, k_cache, v_cache, scale, window=sliding_window)
        out = torch.empty_like(q)
        for g in groups:
            out[g.token_rows] = self._attend(g, q, k, v, k_cache, v_cache, scale, window=sliding_window)
        return out

    def _attend(self, g: _Group, q, k, v, k_cache, v_cache, scale: float, window: int | None = None) -> torch.Tensor:
        """The group's output rows, [num_group_tokens, H, D] in `g.token_rows` order (`window`: a kernel group's)."""
        if g.kernel_lens is not None:
            return self._kernel(
                q[g.token_rows], k_cache, v_cache, g.block_table, g.kernel_lens, scale, g.kernel_split, window=window
            )
        _, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group_size = num_heads // num_kv_heads
        if g.causal_self:  # one sequence, no context: its keys are this step's k and v
            query, keys, values = (x[g.token_rows].transpose(0, 1)[None] for x in (q, k, v))
            o = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
            return o[0].transpose(0, 1)
        keys = _gather(k_cache, g.block_table)
        values = _gather(v_cache, g.block_table)
        num_seqs = g.block_table.shape[0]
        if g.pad_index is None:  # decodes: the group's query heads are the rows of their KV head
            query = q[g.token_rows].view(num_seqs, num_kv_heads, group_size, head_dim)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=g.mask, scale=scale)
            return o.reshape(num_seqs, num_heads, head_dim)
        query = q[g.pad_index].transpose(1, 2)  # [S, Q, H, D] -> [S, H, Q, D]
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=g.mask, scale=scale, enable_gqa=True)
        return o.transpose(1, 2)[g.valid]

    def copy_blocks(self, caches: list[torch.Tensor], src_dst: torch.Tensor) -> None:
        if src_dst.numel() == 0:
            return
        src_dst = src_dst.to(caches[0].device)
        src, dst = src_dst[:, 0], src_dst[:, 1]
        for cache in caches:
            cache.index_copy_(0, dst, cache.index_select(0, src))

    @staticmethod
    def _write_kv(
        k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: _StepLayout
    ) -> None:
        if layout.write_rows is not None:
            k, v = k[layout.write_rows], v[layout.write_rows]
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, layout.write_slots, k.to(k_cache.dtype))
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, layout.write_slots, v.to(v_cache.dtype))

    def _layout_for(self, meta: AttentionMetadata, block_size: int, kernel) -> _StepLayout:
        if meta is not self._layout_meta:
            self._layout = _build_layout(meta, block_size, kernel)
            self._layout_meta = meta
        return self._layout


def _write_only_layout(meta: AttentionMetadata) -> _StepLayout:
    slot_mapping = meta.slot_mapping.long()
    written = slot_mapping >= 0
    if bool(written.all()):
        return _StepLayout(write_rows=None, write_slots=slot_mapping, groups=[])
    rows = written.nonzero().squeeze(1)
    return _StepLayout(write_rows=rows, write_slots=slot_mapping[rows], groups=[])


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[num_blocks, B, KVH, D] paged cache -> [S, KVH, num_cols * B, D] per sequence."""
    num_seqs, cols = block_table.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    blocks = cache.index_select(0, block_table.flatten())  # [S * cols, B, KVH, D], far faster than cache[table]
    return blocks.view(num_seqs, cols * block_size, num_kv_heads, head_dim).transpose(1, 2)


# A prefill query at least this long is attended alone (no padding to its neighbours).
LONG_QUERY = 32
# The cost of one more SDPA call (gather, mask, output scatter), in padded key tokens of a
# decode bucket: about 0.1 ms against ~0.35 us per key token on 2 cores. It only sets how
# eagerly buckets are cut; outputs do not depend on it.
BUCKET_CALL_COST = 256


def _build_layout(meta: AttentionMetadata, block_size: int, kernel=None) -> _StepLayout:
    if kernel is not None and meta.max_query_len == 1 and meta.slot_mapping.shape[0] == meta.seq_lens.shape[0]:
        return _decode_only_layout(meta, block_size, kernel)
    slot_mapping = meta.slot_mapping.long()
    written = slot_mapping >= 0
    if bool(written.all()):
        write_rows, write_slots = None, slot_mapping
    else:
        write_rows = written.nonzero().squeeze(1)
        write_slots = slot_mapping[write_rows]

    starts = meta.query_start_loc[:-1].long()
    query_lens = meta.query_start_loc[1:].long() - starts
    seq_lens = meta.seq_lens.long()
    num_seqs = seq_lens.shape[0]
    is_decode = query_lens == 1
    is_long = query_lens >= LONG_QUERY
    decode_ids = is_decode.nonzero().squeeze(1)
    short_ids = (~is_decode & ~is_long).nonzero().squeeze(1)
    long_ids = is_long.nonzero().squeeze(1)

    groups = []
    if decode_ids.numel() and kernel is not None:  # every decode in one kernel call, no padding
        whole = decode_ids.numel() == num_seqs
        lens = meta.seq_lens[decode_ids].to(torch.int32)
        table = _table(meta.block_table, decode_ids, int(lens.max()), block_size).to(torch.int32)
        rows = slice(None) if whole else starts[decode_ids]
        split = _work_split(kernel, lens)
        groups.append(_Group(rows, table, None, 1, None, None, kernel_lens=lens, kernel_split=split))
    elif decode_ids.numel():
        lens = seq_lens[decode_ids]
        if decode_ids.numel() == num_seqs and int(lens.min()) == int(lens.max()):  # one bucket, in order
            groups.append(_decode_group(decode_ids, starts, seq_lens, meta.block_table, block_size, whole=True))
        else:
            order = decode_ids[torch.argsort(lens, stable=True)]
            for bucket in _length_buckets(seq_lens[order].tolist(), block_size):
                groups.append(_decode_group(order[bucket], starts, seq_lens, meta.block_table, block_size, False))
    if short_ids.numel():
        whole = short_ids.numel() == num_seqs
        groups.append(_prefill_group(short_ids, starts, query_lens, seq_lens, meta.block_table, block_size, whole))
    for seq_id in long_ids.tolist():
        ids = long_ids.new_tensor([seq_id])
        groups.append(_prefill_group(ids, starts, query_lens, seq_lens, meta.block_table, block_size, num_seqs == 1))
    return _StepLayout(write_rows=write_rows, write_slots=write_slots, groups=groups)


def _work_split(kernel, lens: torch.Tensor) -> list[int] | None:
    """The sequences' split over threads for a kernel that takes one (None: its OpenMP entry splits the work itself)."""
    return None if kernel.parts_function is not None else kernel.split(lens)


def _decode_only_layout(meta: AttentionMetadata, block_size: int, kernel) -> _StepLayout:
    """A step of decodes only (one token per sequence, in order): _build_layout's kernel group with
    a few tensor ops instead of its twenty (about 50 us a step and KV cache group on this CPU; six
    groups for Gemma 3)."""
    slot_mapping = meta.slot_mapping.long()
    if bool((slot_mapping >= 0).all()):
        write_rows, write_slots = None, slot_mapping
    else:
        write_rows = (slot_mapping >= 0).nonzero().squeeze(1)
        write_slots = slot_mapping[write_rows]
    lens = meta.seq_lens.to(torch.int32)
    table = meta.block_table[:, : -(-meta.max_seq_len // block_size)].to(torch.int32)
    group = _Group(slice(None), table, None, 1, None, None, kernel_lens=lens, kernel_split=_work_split(kernel, lens))
    return _StepLayout(write_rows=write_rows, write_slots=write_slots, groups=[group])


def _length_buckets(sorted_lens: list[int], block_size: int) -> list[slice]:
    """Cut ascending sequence lengths into contiguous buckets, each padded to its longest
    sequence (in whole blocks), minimising padded key tokens + BUCKET_CALL_COST per bucket.

    Exact dynamic programme over cut points, O(n^2) in numpy for n sequences (n <= a few
    hundred, once per step).
    """
    n = len(sorted_lens)
    padded = np.asarray([-(-length // block_size) * block_size for length in sorted_lens], dtype=np.int64)
    best = np.zeros(n + 1, dtype=np.int64)  # best[j]: cost of the first j sequences
    cut = np.zeros(n + 1, dtype=np.int64)  # where the last bucket of the first j sequences starts
    for j in range(1, n + 1):
        i = np.arange(j)
        cost = best[:j] + (j - i) * padded[j - 1] + BUCKET_CALL_COST
        k = int(cost.argmin())
        best[j], cut[j] = cost[k], k
    buckets, j = [], n
    while j > 0:
        buckets.append(slice(int(cut[j]), j))
        j = int(cut[j])
    return buckets[::-1]


def _table(block_table: torch.Tensor, seq_ids: torch.Tensor, max_seq_len: int, block_size: int) -> torch.Tensor:
    """The rows `seq_ids` of the block table, cut to the blocks of the longest: a contiguous copy."""
    cols = -(-max_seq_len // block_size)
    return block_table[seq_ids, :cols]


def _decode_group(
    seq_ids: torch.Tensor,
    starts: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    whole: bool,
) -> _Group:
    lens = seq_lens[seq_ids]
    table = _table(block_table, seq_ids, int(lens.max()), block_size)
    keys = torch.arange(table.shape[1] * block_size, device=lens.device)
    mask = (keys[None, :] < lens[:, None])[:, None, None, :]  # [S, 1, 1, L]
    rows = slice(None) if whole else starts[seq_ids]
    return _Group(token_rows=rows, block_table=table, mask=mask, query_len=1, pad_index=None, valid=None)


def _prefill_group(
    seq_ids: torch.Tensor,
    starts: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    whole: bool,
) -> _Group:
    lens, qlens, first = seq_lens[seq_ids], query_lens[seq_ids], starts[seq_ids]
    max_query_len = int(qlens.max())
    if seq_ids.numel() == 1 and int(lens[0]) == max_query_len:
        start = int(first[0])
        rows = slice(None) if whole else slice(start, start + max_query_len)
        return _Group(rows, block_table[:0], None, max_query_len, None, None, causal_self=True)
    table = _table(block_table, seq_ids, int(lens.max()), block_size)
    rows = torch.arange(max_query_len, device=lens.device)
    valid = rows[None, :] < qlens[:, None]  # [S, Q]
    pad_index = torch.where(valid, first[:, None] + rows[None, :], first[:, None])
    keys = torch.arange(table.shape[1] * block_size, device=lens.device)
    # query row r of sequence i sits at position context_len_i + r and sees keys 0..that position;
    # padded rows see key 0 only, so no row of the softmax is empty.
    last_key = torch.where(valid, (lens - qlens)[:, None] + rows[None, :], 0)  # [S, Q]
    mask = (keys[None, None, :] <= last_key[:, :, None])[:, None]  # [S, 1, Q, L]
    return _Group(pad_index[valid], table, mask, max_query_len, pad_index, valid)
