"""The contract every attention backend keeps (`torch`, `triton`).

A step's batch is flat and unpadded: the scheduled tokens of every request, request
after request. Request i owns query rows `query_start_loc[i] : query_start_loc[i + 1]`;
they sit at positions `seq_lens[i] - query_len_i ... seq_lens[i] - 1` of its sequence,
so attention is causal with the context offset `context_len_i = seq_lens[i] - query_len_i`.

KV cache, per layer::

    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim]
    slot s           = block_id * block_size + offset;  block 0 is the null block

    position p of request i  ->  block_table[i, p // block_size] * block_size + p % block_size
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = do not write
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: context + this step's tokens
    block_table: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0 (null block)
    max_query_len: int
    max_seq_len: int
    # Gemma 3's images: each (sequence, first query row, query rows, first query's position, image end)
    # of a step's queries inside an image, which attend to every key of that image (executor_svc.vision)
    image_spans: tuple[tuple[int, int, int, int, int], ...] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Write k and v into their slots, then attend; returns [num_tokens, num_heads, head_dim].

        `sliding_window` W: a query at position p sees the keys at p - W + 1 .. p only (the
        blocks before may have been freed); `logits_soft_cap` c: scores become tanh(s / c) * c
        before the mask. A layer without either is called without them.
        """
        ...

    def copy_blocks(self, caches: list[torch.Tensor], src_dst: torch.Tensor) -> None:
        """For each row (src, dst) of `src_dst` [num_copies, 2] int64, copy block src into dst in every cache."""
        ...
