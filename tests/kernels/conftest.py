"""Kernel tests run on CUDA when there is a GPU, else on CPU tensors under the Triton interpreter.

TRITON_INTERPRET is read when a kernel is decorated, i.e. when `kernels` is first imported,
so it is set here, before any test module imports it.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: a heavier kernel case (long contexts); deselect with -m 'not slow'")


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def skip_unless_the_gpu_converts(cache_dtype: torch.dtype, device: torch.device) -> None:
    """Skip an FP8 KV case the executor refuses on this GPU (e4m3 before sm_89: Triton cannot convert it)."""
    from executor_svc.attention import device_kv_cache_dtype

    e4m3 = torch.float8_e4m3fn
    if device.type == "cuda" and cache_dtype == e4m3 and device_kv_cache_dtype("fp8", device) != e4m3:
        pytest.skip("float8_e4m3fn on a GPU before compute capability 8.9")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
