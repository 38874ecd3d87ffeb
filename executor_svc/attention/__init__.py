"""Attention backends: `torch` (portable, the CPU default) and `triton` (kernels/, the CUDA default)."""

from __future__ import annotations

import torch

from executor_svc.attention.base import AttentionBackend, AttentionMetadata

BACKEND_NAMES = ("torch", "triton")


def default_backend_name(device: torch.device | str) -> str:
    return "triton" if torch.device(device).type == "cuda" else "torch"


def get_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend `name` ("auto", "torch" or "triton") for `device`; triton is imported only when asked."""
    if name == "auto":
        name = default_backend_name(device)
    if name == "torch":
        from executor_svc.attention.torch_backend import TorchBackend

        return TorchBackend(device)
    if name == "triton":
        if torch.device(device).type != "cuda":
            raise ValueError(f"attention backend 'triton' needs a CUDA device, not {device}")
        from executor_svc.attention.triton_backend import TritonBackend

        return TritonBackend(device)
    raise ValueError(f"unknown attention backend {name!r} (expected auto or one of {BACKEND_NAMES})")


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKEND_NAMES", "default_backend_name", "get_backend"]
