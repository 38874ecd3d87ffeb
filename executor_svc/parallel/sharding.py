"""Megatron-style shard spec of a Llama-family checkpoint: which slice of each tensor a rank holds.

    q/k/v_proj, gate/up_proj   column-parallel: rows split by head / by intermediate column
    o_proj, down_proj          row-parallel: input columns split, outputs summed (all-reduce);
                               the bias is held by rank 0 only (zeros elsewhere: added once)
    embed_tokens, lm_head      vocab-parallel: vocabulary rows split
    norms                      replicated

KV heads: with at least as many KV heads as ranks each rank holds `num_kv_heads / N` of
them; with fewer, each rank holds the one KV head its query heads read (replicated over
`N / num_kv_heads` ranks). The rank's `ModelConfig` counts its own heads and intermediate
columns, so the model and the KV cache are built from it unchanged.

Slices are read through `safe_open(...).get_slice(name)[...]`: only the rank's bytes are
read from the file.
"""

from __future__ import annotations

import dataclasses

import torch

from executor_svc.loader import UnsupportedModelError
from executor_svc.model import ModelConfig


class TensorShards:
    """The rank's share of a model: its config and `read(name, slice)` for the loader."""

    def __init__(self, config: ModelConfig, rank: int, size: int) -> None:
        check_split(config, size)
        self.full = config
        self.rank = rank
        self.size = size
        self.num_heads = config.num_heads // size
        self.num_kv_heads = max(1, config.num_kv_heads // size)
        group = config.num_heads // config.num_kv_heads  # query heads per KV head
        self.first_kv_head = rank * self.num_heads // group
        self.intermediate = config.intermediate_size // size
        self.vocab_rows = config.vocab_size // size
        self.local_config = dataclasses.replace(
            config,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate,
        )

    def read(self, name: str, tensor_slice) -> torch.Tensor:
        """The rows / columns of checkpoint tensor `name` this rank holds.

        `tensor_slice`: a safetensors slice (only those bytes are read), or a whole tensor
        (e.g. one dequantized from another format): both are indexed alike.
        """
        d = self.full.head_dim
        kind = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        is_bias = name.endswith(".bias")
        if kind == "q_proj":
            return self._rows(tensor_slice, self.rank * self.num_heads * d, self.num_heads * d)
        if kind in ("k_proj", "v_proj"):
            return self._rows(tensor_slice, self.first_kv_head * d, self.num_kv_heads * d)
        if kind in ("gate_proj", "up_proj"):
            return self._rows(tensor_slice, self.rank * self.intermediate, self.intermediate)
        if kind in ("o_proj", "down_proj"):
            if is_bias:  # summed over ranks by the all-reduce: added once
                whole = tensor_slice[:]
                return whole if self.rank == 0 else torch.zeros_like(whole)
            width = self.num_heads * d if kind == "o_proj" else self.intermediate
            return tensor_slice[:, self.rank * width : (self.rank + 1) * width]
        if name.endswith("embed_tokens.weight") or name.startswith("lm_head."):
            return self._rows(tensor_slice, self.rank * self.vocab_rows, self.vocab_rows)
        return tensor_slice[:]  # norms: every rank holds them whole

    @staticmethod
    def _rows(tensor_slice, start: int, count: int) -> torch.Tensor:
        return tensor_slice[start : start + count]


def check_split(config: ModelConfig, size: int) -> None:
    """Refuse, with the numbers, a model that cannot be split `size` ways."""
    if size < 1:
        raise UnsupportedModelError(f"tensor-parallel-size {size}: must be at least 1")
    problems = []
    if config.num_heads % size:
        problems.append(f"num_attention_heads {config.num_heads}")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"num_key_value_heads {kv} (neither a multiple nor a divisor of the size)")
    if config.intermediate_size % size:
        problems.append(f"intermediate_size {config.intermediate_size}")
    if config.vocab_size % size:
        problems.append(f"vocab_size {config.vocab_size}")
    if problems:
        raise UnsupportedModelError(
            f"--tensor-parallel-size {size} does not divide this model: " + ", ".join(problems)
        )
