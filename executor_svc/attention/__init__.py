"""Attention backends: `torch` (portable, the CPU default) and `triton` (kernels/, the CUDA default)."""

from __future__ import annotations

import os

import torch

from executor_svc.attention.base import AttentionBackend, AttentionMetadata

BACKEND_NAMES = ("torch", "triton")


def default_backend_name(device: torch.device | str) -> str:
    return "triton" if torch.device(device).type == "cuda" else "torch"


def get_backend(
    name: str, device: torch.device | str, kv_cache_dtype: str = "auto", decode_kernel: bool = True
) -> AttentionBackend:
    """The backend `name` ("auto", "torch" or "triton") for `device`; triton is imported only when asked.

    `kv_cache_dtype` "fp8" (e4m3, scales 1.0) needs the triton backend. `decode_kernel`: the torch
    backend's decodes on a CPU through the C kernel where it builds (False: SDPA).
    """
    if name == "auto":
        name = default_backend_name(device)
    if name == "torch":
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} needs --attention-backend triton")
        from executor_svc.attention.torch_backend import TorchBackend

        return TorchBackend(device, decode_kernel=None if decode_kernel else False)
    if name == "triton":
        if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1), not {device}")
        from executor_svc.attention.triton_backend import TritonBackend

        return TritonBackend(device, kv_cache_dtype=kv_cache_dtype)
    raise ValueError(f"unknown attention backend {name!r} (expected auto or one of {BACKEND_NAMES})")


__all__ = ["BACKEND_NAMES", "AttentionBackend", "AttentionMetadata", "default_backend_name", "get_backend"]
