"""`triton`: the attention backend built on kernels/ (the default on CUDA).

Each layer's forward is two launches: `reshape_and_cache` writes this step's K/V into
their slots, then `paged_attention` attends every query row of the flat batch, prefill
chunks and decodes together, straight from the paged cache (split-KV when a decode-only
batch is too small to fill the GPU). With an fp8 cache (`kv_cache_dtype` "fp8_e4m3", "fp8_e5m2"
or "fp8": see `executor_svc.attention.kv_cache_dtype_for`) K/V are stored as float8_e4m3fn or
float8_e5m2 divided by `k_scale` / `v_scale` and multiplied back on load.
"""

from __future__ import annotations

import torch

from executor_svc.attention import device_kv_cache_dtype, windowed
from executor_svc.attention.base import AttentionMetadata
from kernels.copy_blocks import copy_blocks
from kernels.paged_attention import FP8_DTYPES, paged_attention
from kernels.reshape_and_cache import reshape_and_cache


class TritonBackend:
    name = "triton"

    def __init__(
        self,
        device: torch.device | str | None = None,
        kv_cache_dtype: str | torch.dtype = "auto",
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """`kv_cache_dtype`: "auto" (the model's dtype), a `--kv-cache-dtype` fp8 name (refused where `device`
        cannot convert it) or torch.float8_e4m3fn / float8_e5m2; the scales apply to fp8 only."""
        self.device = torch.device(device) if device is not None else None
        if isinstance(kv_cache_dtype, torch.dtype):
            if kv_cache_dtype not in FP8_DTYPES:
                raise ValueError(f"kv_cache_dtype {kv_cache_dtype}: expected 'auto' or one of {FP8_DTYPES}")
            self.kv_cache_dtype: torch.dtype | None = kv_cache_dtype
        else:
            self.kv_cache_dtype = device_kv_cache_dtype(kv_cache_dtype, self.device or "cpu")
        if self.kv_cache_dtype is None and (k_scale != 1.0 or v_scale != 1.0):
            raise ValueError("k_scale and v_scale apply to an fp8 KV cache only")
        if not (k_scale > 0.0 and v_scale > 0.0):
            raise ValueError(f"k_scale and v_scale must be positive, got {k_scale} and {v_scale}")
        self.k_scale = float(k_scale)
        self.v_scale = float(v_scale)

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype to allocate the KV cache in for a model computing in `model_dtype`."""
        return self.kv_cache_dtype or model_dtype

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
        """`sliding_window` / `logits_soft_cap`: such a layer attends through `windowed.attend` (no kernel yet)."""
        if k_cache.dtype != self.cache_dtype(q.dtype):
            raise ValueError(f"KV cache is {k_cache.dtype}, this backend expects {self.cache_dtype(q.dtype)}")
        reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale=self.k_scale, v_scale=self.v_scale)
        if sliding_window is not None or logits_soft_cap is not None:
            if self.kv_cache_dtype is not None:
                raise NotImplementedError("sliding windows and soft-capping with an fp8 KV cache")
            return windowed.attend(q, k_cache, v_cache, meta, scale, sliding_window, logits_soft_cap)
        return paged_attention(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            scale,
            meta.max_query_len,
            meta.max_seq_len,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )

    def copy_blocks(self, caches: list[torch.Tensor], src_dst: torch.Tensor) -> None:
        if not caches or src_dst.numel() == 0:
            return
        copy_blocks(caches, src_dst.to(device=caches[0].device, dtype=torch.int64))
