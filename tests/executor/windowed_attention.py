"""A plain per-sequence attention that keeps each layer to its sliding window, for tests.

It stands in for the model's own attention (`AttentionBackend`) where that does not mask
windows yet, so that the KV memory of sliding windows -- the scheduler's freed blocks, the
executor's per-group tables -- is checked against transformers on real weights. The layer
of each call is its position in the step (the model calls the backend once per layer, in
order); a layer reads its keys through its block table from position `p - W + 1` on
only, so a block the scheduler freed (whose stale id may hold another request's KV) is
never read.
"""

from __future__ import annotations

import torch

from executor_svc.attention.base import AttentionMetadata


class WindowedReferenceAttention:
    name = "torch"

    def __init__(self, layer_windows: tuple[int | None, ...]) -> None:
        self.layer_windows = layer_windows
        self._num_calls = 0

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, sliding_window=None) -> torch.Tensor:
        window = self.layer_windows[self._num_calls % len(self.layer_windows)]
        assert sliding_window in (None, window)  # the model's own window, where it passes one
        self._num_calls += 1
        block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
        written = meta.slot_mapping >= 0
        k_cache.flatten(0, 1)[meta.slot_mapping[written]] = k[written].to(k_cache.dtype)
        v_cache.flatten(0, 1)[meta.slot_mapping[written]] = v[written].to(v_cache.dtype)
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        for i, seq_len in enumerate(meta.seq_lens.tolist()):
            query_len = starts[i + 1] - starts[i]
            first = 0 if window is None else max(seq_len - query_len - window + 1, 0)
            pos = torch.arange(first, seq_len)
            slots = meta.block_table[i, pos // block_size].long() * block_size + pos % block_size
            keys = k_cache.flatten(0, 1)[slots].repeat_interleave(group, dim=1).double()  # [L, H, D]
            values = v_cache.flatten(0, 1)[slots].repeat_interleave(group, dim=1).double()
            q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
            visible = pos[None, :] <= q_pos
            if window is not None:
                visible &= pos[None, :] > q_pos - window
            rows = slice(starts[i], starts[i + 1])
            scores = torch.einsum("qhd,khd->hqk", q[rows].double(), keys) * scale
            scores = scores.masked_fill(~visible[None], float("-inf"))
            out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
        return out

    def copy_blocks(self, caches: list[torch.Tensor], src_dst: torch.Tensor) -> None:
        for cache in caches:
            cache[src_dst[:, 1]] = cache[src_dst[:, 0]]
