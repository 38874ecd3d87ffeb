"""The executor's KV cache spec: each layer's attention window, the groups of layers that share a
block table, and where each layer's K and V live (vLLM's KVCacheSpec / KVCacheGroupSpec).

Layers of one attention type (full attention, or one sliding window) need the same
blocks for a request, so they share one block table: a KV cache group. Every group holds
the same number of layers, `group_size` (the fewest layers of any type; the last group of
a type may hold fewer, the rest is padding), so that one block -- `group_size` layers'
K and V of `block_size` tokens -- has one size whatever group owns it, and all groups
draw from one pool::

    Gemma 3 1B: 26 layers, every 6th global, window 512 -> 4 global, 22 local, group_size 4
    group 0  full     layers  5 11 17 23
    group 1  window   layers  0  1  2  3
    ...
    group 6  window   layers 24 25  .  .      (two padding slots)

    tensors  K[0] V[0] ... K[3] V[3], each [num_blocks, block_size, num_kv_heads, head_dim]
    layer 5 -> tensors 0 (group 0, slot 0); layer 1 -> tensors 1 (group 1, slot 1); ...

A block id belongs to one group at a time, so the layers that share a tensor never share
a block. A model with only full attention is one group of every layer: a tensor per
layer, as without groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagoda.step import KVCacheGroupSpec


def layer_sliding_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention) from a Hugging Face config (object or dict).

    Reads, first found: `layer_types` ("sliding_attention" / "full_attention", as
    transformers 5 writes them for Gemma 2/3, Qwen2, ...); Gemma 3's
    `sliding_window_pattern` (every n-th layer global); Gemma 2's alternation (even layers
    local); Qwen2's `use_sliding_window` from `max_window_layers` on; otherwise Mistral's
    one `sliding_window` for every layer. A window that covers `max_position_embeddings`
    is full attention.
    """
    get = config.get if isinstance(config, Mapping) else lambda name, default=None: getattr(config, name, default)
    num_layers = get("num_hidden_layers") or get("num_layers")
    window = get("sliding_window")
    max_positions = get("max_position_embeddings")
    if window is not None and max_positions is not None and window >= max_positions:
        window = None
    layer_types = get("layer_types")
    if layer_types is not None:
        kinds = [kind == "sliding_attention" for kind in layer_types]
    elif get("sliding_window_pattern"):
        pattern = get("sliding_window_pattern")
        kinds = [(i + 1) % pattern != 0 for i in range(num_layers)]
    elif get("model_type") == "gemma2":
        kinds = [i % 2 == 0 for i in range(num_layers)]
    elif get("model_type") == "qwen2":
        first = get("max_window_layers", num_layers) if get("use_sliding_window", False) else num_layers
        kinds = [i >= first for i in range(num_layers)]
    else:
        kinds = [True] * num_layers
    if any(kinds) and window is None:
        kinds = [False] * len(kinds)
    return tuple(window if sliding else None for sliding in kinds)


def kv_cache_groups(layer_windows: Sequence[int | None]) -> tuple[KVCacheGroupSpec, ...]:
    """Split the layers into groups of one window each, `group_size` layers a group, full attention first.

    `group_size` is the fewest layers of any window (vLLM's rule for Gemma 3's 5:1: the "1").
    """
    if not layer_windows:
        raise ValueError("a model without layers has no KV cache")
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    group_size = min(len(layers) for layers in by_window.values())
    order = sorted(by_window, key=lambda window: (window is not None, window or 0))
    return tuple(
        KVCacheGroupSpec(tuple(layers[start : start + group_size]), window)
        for window in order
        for layers in (by_window[window],)
        for start in range(0, len(layers), group_size)
    )


@dataclass(frozen=True)
class KVCacheLayout:
    """Where each layer's K and V are: tensor pair `slot_of[layer]` (its place in its group)."""

    groups: tuple[KVCacheGroupSpec, ...]
    num_layers: int

    def __post_init__(self) -> None:
        layers = sorted(layer for group in self.groups for layer in group.layer_ids)
        if layers != list(range(self.num_layers)):
            raise ValueError(f"KV cache groups {self.groups} must name every one of {self.num_layers} layers once")

    @property
    def num_tensors(self) -> int:
        """K and V tensor pairs: the layers of the largest group (every group's blocks hold that many)."""
        return max(len(group.layer_ids) for group in self.groups)

    @property
    def group_of(self) -> tuple[int, ...]:
        return tuple(self._place(layer)[0] for layer in range(self.num_layers))

    @property
    def slot_of(self) -> tuple[int, ...]:
        return tuple(self._place(layer)[1] for layer in range(self.num_layers))

    def _place(self, layer: int) -> tuple[int, int]:
        for group_id, group in enumerate(self.groups):
            if layer in group.layer_ids:
                return group_id, group.layer_ids.index(layer)
        raise KeyError(layer)
