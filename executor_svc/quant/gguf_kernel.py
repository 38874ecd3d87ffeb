"""The GGUF matmul kernel (`csrc/gguf_matmul.c`): y = x @ dequant(W).T with W kept in its blocks.

At one token a decode step is bound by the bytes of weight it reads: a Q4_1 weight is 5 bits
a value where float32 is 32. No library multiplies GGUF blocks by float32 activations with
float32 accumulation (llama.cpp quantizes the activations too, which changes the numbers;
torch's int4/int8 weight-only ops take their own layouts and scales, and FBGEMM's dynamic
int8 quantizes the activations), so this is a C kernel of ours, built like the decode
attention kernel (`executor_svc.cbuild`), with its own small thread pool inside (one ctypes
call per matmul: a Python thread hand-off per call would cost more than a small matmul): torch's
OpenMP team where the library can share torch's runtime (`cbuild.load_openmp`), else a pthread pool.

Every block type of llama.cpp's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and K-quant (Q2_K-Q6_K) families is
fused with AVX2 + FMA + F16C (`csrc/gguf_avx2.h`; Q5_0/Q5_1 and the K-quants with AVX-512 F/BW/VL
where the CPU has it, `csrc/gguf_avx512.h`); a build without them (another CPU) takes a portable
C row path (`csrc/gguf_blocks.h`), with the same numbers up to summation order.

`BackendOptions.gguf_kernel=False` (`PAGODA_GGUF_KERNEL=0`) keeps it out: GGUF weights are then
dequantized into float32 at load.
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
CFLAGS = (*cbuild.BASE_CFLAGS, "-pthread")  # -march=native: AVX2/FMA/F16C where this CPU has them

INT8_TYPES = frozenset((6, 12, 14))  # Q5_0, Q4_K, Q6_K: the types with int8-activation loops
I8_ROW = 1000  # the kernel's own int8 layout (not a GGML type): float32 row scale, then int8 values

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class GGUFKernel:
    """Matmul and row dequantization of GGUF blocks (float32 in and out, CPU).

    One caller at a time (the C side runs one job at a time on its pool, and the scratch here
    is shared).
    """

    def __init__(self, library: ctypes.CDLL, num_threads: int, openmp: bool = False) -> None:
        library.gguf_matmul.argtypes = [_int, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr]
        library.gguf_matmul.restype = None
        library.gguf_matmul_strided.argtypes = [_int, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64]
        library.gguf_matmul_strided.restype = None
        library.gguf_block_weights.argtypes = [_int]
        library.gguf_block_weights.restype = _i64
        library.gguf_dequantize.argtypes = [_int, _ptr, _i64, _i64, _ptr, _i64, _ptr]
        library.gguf_dequantize.restype = None
        library.gguf_supported.argtypes = [_int]
        library.gguf_set_threads.argtypes = [_int]
        library.gguf_use_openmp.argtypes = [_int]
        library.gguf_set_int8_activations.argtypes = [_int]
        library.gguf_set_digit_activations.argtypes = [_int]
        self._lib = library
        library.gguf_max_k.restype = _i64
        self.max_k = library.gguf_max_k()
        self.simd = bool(library.gguf_simd())  # fused AVX2 loops (else the portable row path)
        self.openmp = bool(library.gguf_use_openmp(int(openmp)))  # jobs on torch's OpenMP team
        self.num_threads = library.gguf_set_threads(max(1, num_threads))
        self.int8_activations_supported = bool(library.gguf_set_int8_activations(1))
        self.int8_activations = bool(library.gguf_set_int8_activations(0))
        self.digit_activations = bool(library.gguf_set_digit_activations(1))
        # one caller at a time (the C side's pool is one job at a time too), so one scratch will do
        self._scratch = torch.empty(0, dtype=torch.float32)

    def set_int8_activations(self, on: bool) -> bool:
        """Opt-in int8 activations (`--gguf-int8-activations`): from now on a Q5_0, Q4_K or Q6_K matmul rounds
        each row of x to int8 per block of 32 and multiplies bytes, as llama.cpp does (faster, not the
        float32 numbers: see gguf_avx512.h); every other type keeps float32 x. A row's product is the same
        bits whatever the number of rows beside it (gguf_q8_rows.h; Q6_K: within float rounding).
        Returns whether it is in effect (off: this build has no AVX2 int8 loop). Process-wide, as the kernel
        is: a Backend sets it from its options."""
        self.int8_activations = bool(self._lib.gguf_set_int8_activations(int(on)))
        return self.int8_activations

    def takes_int8(self, ggml_types: list[int], in_features: int) -> bool:
        """Whether a weight of these segment types takes the int8 loops (with int8 activations on) at any
        number of rows of x; `GGUFLinear` sends it rows up to `INT8_MAX_ROWS` (measured there), so a prompt's
        chunks of that size get the numbers its decode steps get."""
        return self.int8_activations and in_features <= self.max_k and all(t in INT8_TYPES for t in ggml_types)

    def set_digit_activations(self, on: bool) -> bool:
        """Whether a Q5_0 matmul against one row of x carries x as three int8 digits a value (22 bits against
        the largest |x| of each 4 values; the products and sums exact in int32: float32-grade, see
        gguf_avx512.h) rather than widening every weight to a float (the float loop, kept for comparison).
        On by default where the build has AVX-512 VNNI; returns whether it is in effect. Process-wide."""
        self.digit_activations = bool(self._lib.gguf_set_digit_activations(int(on)))
        return self.digit_activations

    def supports(self, ggml_type: int, in_features: int) -> bool:
        """Whether rows of `in_features` weights of this GGML type can stay packed (whole blocks a row)."""
        block = self._lib.gguf_block_weights(ggml_type)
        return block > 0 and in_features % max(block, 32) == 0 and (self.simd or in_features <= self.max_k)

    @staticmethod
    def scratch_floats(num_rows: int, in_features: int) -> int:
        """Floats of scratch a matmul of `num_rows` rows of x needs (x's block sums)."""
        return num_rows * (in_features // 32)

    @property
    def matmul_fn(self):
        """The C entry for callers that run a whole step in C::

            gguf_matmul(int ggml_type, const uint8_t *w, int64 row_bytes, int64 N, int64 K,
                        const float *x, int64 M, float *xs, float *y)

        y [M][N] = x @ dequant(W).T, the arguments as `matmul_strided_fn`'s with ldy = N.
        """
        return self._lib.gguf_matmul

    @property
    def matmul_strided_fn(self):
        """The C entry for callers that run a whole step in C, one call per weight segment::

            gguf_matmul_strided(int ggml_type, const uint8_t *w, int64 row_bytes, int64 N, int64 K,
                                const float *x, int64 M, float *xs, float *y, int64 ldy)

        y[m * ldy + n] = (x @ dequant(W).T)[m][n] for m < M, n < N: x [M][K] float32 contiguous,
        W [N][row_bytes] packed rows, xs a scratch of `scratch_floats(M, K)` floats (overwritten),
        y's rows ldy >= N floats apart, so each segment of a merged projection (q/k Q4_K, v Q6_K)
        writes its columns of one output in place. One caller at a time; threads as `num_threads`.
        """
        return self._lib.gguf_matmul_strided

    def _sums(self, num_rows: int, in_features: int) -> int:
        floats = self.scratch_floats(num_rows, in_features)
        if floats > self._scratch.numel():
            self._scratch = torch.empty(floats, dtype=torch.float32)
        return self._scratch.data_ptr()

    def matmul(self, ggml_type: int, packed: torch.Tensor, in_features: int, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 contiguous -> [M, N]; `packed` [N, row_bytes] uint8."""
        m = x.shape[0]
        n, row_bytes = packed.shape
        out = torch.empty(m, n, dtype=torch.float32)
        self._lib.gguf_matmul(
            ggml_type, packed.data_ptr(), row_bytes, n, in_features, x.data_ptr(), m, self._sums(m, in_features),
            out.data_ptr(),
        )
        return out

    def matmul_columns(
        self, ggml_type: int, packed: torch.Tensor, in_features: int, x: torch.Tensor, y: torch.Tensor, start: int
    ) -> None:
        """y[:, start:start + N] = x @ dequant(W).T, with y a contiguous float32 [M, width] (unchecked: the
        lean path of merged projections at decode shapes, one C call and no view); `packed` [N, row_bytes]."""
        n, row_bytes = packed.shape
        m = x.shape[0]
        self._lib.gguf_matmul_strided(
            ggml_type, packed.data_ptr(), row_bytes, n, in_features, x.data_ptr(), m, self._sums(m, in_features),
            y.data_ptr() + 4 * start, y.shape[1],
        )

    def matmul_into(
        self, ggml_type: int, packed: torch.Tensor, in_features: int, x: torch.Tensor, out: torch.Tensor
    ) -> None:
        """out[:] = x @ dequant(W).T, with `out` any [M, N] float32 view whose rows are contiguous
        (e.g. the columns `y[:, start:start + N]` of a merged projection's output).

        x [M, K] float32 contiguous; `packed` [N, row_bytes] uint8.
        """
        m = x.shape[0]
        n, row_bytes = packed.shape
        rows_ok = (n == 1 or out.stride(1) == 1) and (m == 1 or out.stride(0) >= n)
        if out.shape != (m, n) or out.dtype != torch.float32 or not rows_ok:
            raise ValueError(f"out: need a float32 [{m}, {n}] view with contiguous rows, got {out.dtype} "
                             f"{tuple(out.shape)} strides {out.stride()}")
        self._lib.gguf_matmul_strided(
            ggml_type, packed.data_ptr(), row_bytes, n, in_features, x.data_ptr(), m, self._sums(m, in_features),
            out.data_ptr(), max(out.stride(0), n)
        )

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
    """The process's kernel (built on first use), or None where it cannot be built."""
    global _kernel
    with _lock:
        if _kernel is False:
            what = "GGUF matmul kernel (weights dequantized to float32 instead)"
            library, openmp = cbuild.load_openmp(SOURCE, CFLAGS, what)
            _kernel = None if library is None else GGUFKernel(library, torch.get_num_threads(), openmp)
            if _kernel is not None:
                log.info("GGUF matmul kernel on %d thread(s)%s", _kernel.num_threads,
                         " (torch's OpenMP team)" if _kernel.openmp else "")
        return _kernel
