"""Attention backends: `torch` (portable, the CPU default) and `triton` (kernels/, the CUDA default)."""

from __future__ import annotations

import os

import torch

from executor_svc.attention.base import AttentionBackend, AttentionMetadata

BACKEND_NAMES = ("torch", "triton")
# --kv-cache-dtype, as vLLM names them: auto = the model's dtype; fp8 = fp8_e4m3 where the GPU has it
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# Triton converts float8_e4m3fn on NVIDIA GPUs from Ada (L4, RTX 40xx) and Hopper on; float8_e5m2
# from Ampere (A100 8.0, A10 / RTX 30xx 8.6). "type fp8e4nv not supported in this architecture"
# is what sm_80 says (bench/kernel_compile_table.py compiles both formats for each target).
E4M3_MIN_CAPABILITY = (8, 9)


def default_backend_name(device: torch.device | str) -> str:
    return "triton" if torch.device(device).type == "cuda" else "torch"


def kv_cache_dtype_for(
    name: str, capability: tuple[int, int] | None = None, *, rocm: bool = False, gpu_name: str = "this GPU"
) -> torch.dtype | None:
    """The KV cache dtype that `--kv-cache-dtype name` gives (None: the model's) on a GPU of compute `capability`.

    `capability` None is no GPU (the Triton interpreter converts both formats); `rocm`: an AMD GPU
    (Triton converts both). `fp8` is fp8_e4m3 where the GPU has it, else fp8_e5m2 (its range, two
    mantissa bits); fp8_e4m3 asked of an NVIDIA GPU before 8.9 is refused with the flag and the GPU.
    """
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    if name == "auto":
        return None
    has_e4m3 = capability is None or rocm or tuple(capability) >= E4M3_MIN_CAPABILITY
    if name == "fp8":
        name = "fp8_e4m3" if has_e4m3 else "fp8_e5m2"
    if name == "fp8_e4m3" and not has_e4m3:
        major, minor = capability
        raise ValueError(
            f"--kv-cache-dtype fp8_e4m3: {gpu_name} has compute capability {major}.{minor}, and Triton converts "
            f"float8_e4m3fn from {E4M3_MIN_CAPABILITY[0]}.{E4M3_MIN_CAPABILITY[1]} on (L4, RTX 40xx, H100); "
            "use --kv-cache-dtype fp8_e5m2 (or fp8, which picks it on this GPU)"
        )
    return torch.float8_e4m3fn if name == "fp8_e4m3" else torch.float8_e5m2


def device_kv_cache_dtype(name: str, device: torch.device | str) -> torch.dtype | None:
    """`kv_cache_dtype_for` on `device`: its compute capability and name when it is a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return kv_cache_dtype_for(name)
    return kv_cache_dtype_for(
        name, torch.cuda.get_device_capability(device), rocm=torch.version.hip is not None,
        gpu_name=torch.cuda.get_device_name(device),
    )


def get_backend(
    name: str, device: torch.device | str, kv_cache_dtype: str = "auto", decode_kernel: bool = True
) -> AttentionBackend:
    """The backend `name` ("auto", "torch" or "triton") for `device`; triton is imported only when asked.

    `kv_cache_dtype` other than "auto" (an fp8 one of KV_CACHE_DTYPES, scales 1.0) needs the triton
    backend. `decode_kernel`: the torch backend's decodes on a CPU through the C kernel where it
    builds (False: SDPA).
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


__all__ = [
    "BACKEND_NAMES", "KV_CACHE_DTYPES", "AttentionBackend", "AttentionMetadata", "default_backend_name",
    "device_kv_cache_dtype", "get_backend", "kv_cache_dtype_for",
]
