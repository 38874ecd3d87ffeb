"""Paged attention for the layers the fast paths do not cover: a sliding window, logit soft-capping.

Either backend calls `attend` for such a layer after it has written this step's K and V.
Query row r of sequence i sits at position p = context_len_i + r and sees the keys at
positions j with

    j <= p   and   j > p - sliding_window        (transformers' sliding-window causal mask)

Only the blocks that hold a visible key are read: each sequence's table is read from the
block of its first visible key on (`first_col`), so a block the scheduler has freed outside
the window -- whose stale id may now hold another request's K and V -- is never gathered::

    block table row   [ b0 | b1 | b2 | b3 | b4 ]      window 6, block size 4, p = 17
    visible keys                  12 .. 17            -> cols 3..4 only (b0..b2 freed)

Scores are `q . k * scale`, soft-capped as `tanh(s / cap) * cap` before the mask, and the
softmax is in float32 (transformers' eager attention, which Gemma 2 uses for its cap).
"""

from __future__ import annotations

import torch

from executor_svc.attention.base import AttentionMetadata


def attend(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, B, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> torch.Tensor:
    """[T, H, D]: every query row attended over its visible keys (see the module docstring)."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    starts = meta.query_start_loc[:-1].long()
    query_lens = meta.query_start_loc[1:].long() - starts
    seq_lens = meta.seq_lens.long()
    context_lens = seq_lens - query_lens
    device = q.device
    if sliding_window is None:
        first_key = torch.zeros_like(seq_lens)
    else:
        first_key = (context_lens - sliding_window + 1).clamp(min=0)
    first_col = first_key // block_size
    num_cols = int(((seq_lens - 1) // block_size - first_col).max()) + 1
    cols = first_col[:, None] + torch.arange(num_cols, device=device)[None, :]  # [S, C]
    in_table = cols < meta.block_table.shape[1]
    block_ids = meta.block_table.long().gather(1, cols.clamp(max=meta.block_table.shape[1] - 1))
    block_ids = block_ids.masked_fill(~in_table, 0)
    num_seqs = seq_lens.shape[0]
    keys = k_cache.index_select(0, block_ids.flatten()).view(num_seqs, num_cols * block_size, num_kv_heads, head_dim)
    values = v_cache.index_select(0, block_ids.flatten()).view(num_seqs, num_cols * block_size, num_kv_heads, head_dim)
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    key_pos = first_col[:, None] * block_size + torch.arange(num_cols * block_size, device=device)[None, :]  # [S, L]

    max_query_len = int(query_lens.max())
    rows = torch.arange(max_query_len, device=device)
    valid = rows[None, :] < query_lens[:, None]  # [S, Q]
    pad_index = torch.where(valid, starts[:, None] + rows[None, :], starts[:, None])
    query_pos = context_lens[:, None] + rows[None, :]  # [S, Q]
    visible = key_pos[:, None, :] <= query_pos[:, :, None]  # [S, Q, L]
    if sliding_window is not None:
        visible &= key_pos[:, None, :] > query_pos[:, :, None] - sliding_window
    visible &= valid[:, :, None]
    visible[:, :, 0] |= ~valid  # a padded row sees one key: no empty softmax

    group = num_heads // num_kv_heads
    query = q[pad_index].transpose(1, 2)  # [S, H, Q, D]
    keys = keys.transpose(1, 2).repeat_interleave(group, dim=1)  # [S, H, L, D]
    values = values.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scale  # [S, H, Q, L]
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(weights, values).transpose(1, 2)  # [S, Q, H, D]
    result = torch.empty_like(q)
    result[pad_index[valid]] = out[valid]
    return result
