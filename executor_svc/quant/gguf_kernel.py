"""The GGUF matmul kernel (`csrc/gguf_matmul.c`): y = x @ dequant(W).T with W kept in its blocks.

At one token a decode step is bound by the bytes of weight it reads: a Q4_1 weight is 5 bits
a value where float32 is 32. No library multiplies GGUF blocks by float32 activations with
float32 accumulation (llama.cpp quantizes the activations too, which changes the numbers;
torch's int4/int8 weight-only ops take their own layouts and scales, and FBGEMM's dynamic
int8 quantizes the activations), so this is a C kernel of ours, built like the decode
attention kernel (`executor_svc.cbuild`), with its own small thread pool inside (one ctypes
call per matmul: a Python thread hand-off per call would cost more than a small matmul).

`PAGODA_GGUF_KERNEL=0` turns it off: `GGUFLinear` then dequantizes into float32 at load.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import torch

from executor_svc import cbuild

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "gguf_matmul.c"
CFLAGS = (*cbuild.BASE_CFLAGS, "-pthread", "-mavx2", "-mfma", "-mf16c")
ENV_SWITCH = "PAGODA_GGUF_KERNEL"

I8_ROW = 1000  # the kernel's own int8 layout (not a GGML type): float32 row scale, then int8 values

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class GGUFKernel:
    """Matmul and row dequantization of GGUF blocks (float32 in and out, CPU)."""

    def __init__(self, library: ctypes.CDLL, num_threads: int) -> None:
        library.gguf_matmul.argtypes = [_int, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr]
        library.gguf_matmul.restype = None
        library.gguf_dequantize.argtypes = [_int, _ptr, _i64, _i64, _ptr, _i64, _ptr]
        library.gguf_dequantize.restype = None
        library.gguf_supported.argtypes = [_int]
        library.gguf_set_threads.argtypes = [_int]
        self._lib = library
        library.gguf_max_k.restype = _i64
        self.max_k = library.gguf_max_k()
        self.num_threads = library.gguf_set_threads(max(1, num_threads))
        # one caller at a time (the C side's pool is one job at a time too), so one scratch will do
        self._scratch = torch.empty(0, dtype=torch.float32)

    def supports(self, ggml_type: int, in_features: int) -> bool:
        return bool(self._lib.gguf_supported(ggml_type)) and in_features <= self.max_k and in_features % 32 == 0

    def matmul(self, ggml_type: int, packed: torch.Tensor, in_features: int, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 contiguous -> [M, N]; `packed` [N, row_bytes] uint8."""
        m = x.shape[0]
        n, row_bytes = packed.shape
        out = torch.empty(m, n, dtype=torch.float32)
        sums = m * (in_features // 32)  # the kernel's scratch: x's block sums
        if sums > self._scratch.numel():
            self._scratch = torch.empty(sums, dtype=torch.float32)
        self._lib.gguf_matmul(
            ggml_type, packed.data_ptr(), row_bytes, n, in_features, x.data_ptr(), m, self._scratch.data_ptr(), out.data_ptr()
        )
        return out

    def dequantize(
        self, ggml_type: int, packed: torch.Tensor, in_features: int, rows: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The float32 rows `rows` (int64; all when None) of the packed weight (into `out`, contiguous, if given)."""
        n = packed.shape[0] if rows is None else rows.shape[0]
        if out is None:
            out = torch.empty(n, in_features, dtype=torch.float32)
        assert out.shape == (n, in_features) and out.dtype == torch.float32 and out.is_contiguous()
        self._lib.gguf_dequantize(
            ggml_type, packed.data_ptr(), packed.shape[1], in_features, 0 if rows is None else rows.data_ptr(), n, out.data_ptr()
        )
        return out


_lock = threading.Lock()
_kernel: GGUFKernel | None | bool = False  # False: not tried yet


def get_kernel() -> GGUFKernel | None:
    """The process's kernel (built on first use), or None where it cannot be built or is off."""
    global _kernel
    with _lock:
        if _kernel is False:
            library = cbuild.load(SOURCE, CFLAGS, ENV_SWITCH, "GGUF matmul kernel (weights dequantized to float32 instead)")
            _kernel = None if library is None else GGUFKernel(library, torch.get_num_threads())
            if _kernel is not None:
                log.info("GGUF matmul kernel on %d thread(s)", _kernel.num_threads)
        return _kernel
