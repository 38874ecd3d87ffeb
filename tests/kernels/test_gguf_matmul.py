"""The GGUF kernel against the `gguf` package's own dequantization, every supported block type, odd shapes.

Blocks come from `tests.gguf_blocks` (K-quants: random bytes with finite scales). The portable C
build (no AVX2) and, on a CPU with AVX-512, the AVX2-only build are checked the same way.
"""

from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from executor_svc import cbuild
from executor_svc.quant import gguf_kernel, gguf_linear
from executor_svc.quant.gguf_kernel import GGUFKernel, get_kernel
from executor_svc.quant.gguf_linear import GGUFLinear
from tests.gguf_blocks import K_QUANT_SCALES, QUANTIZABLE, T, assert_matmul_close, random_blocks

TYPES = [*QUANTIZABLE, *K_QUANT_SCALES]

pytestmark = pytest.mark.skipif(get_kernel() is None, reason="no C compiler: the GGUF kernel is not built")


def packed_weight(ggml_type: GGMLQuantizationType, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Quantized from standard-normal floats, or (K-quants) random bytes with scales in +-0.05."""
    return random_blocks(ggml_type, rows, blocks, seed, scale=1.0 if ggml_type in QUANTIZABLE else 0.05)


@pytest.fixture(scope="module")
def portable_kernel() -> GGUFKernel:
    """The kernel built without AVX2/FMA/F16C: the portable C path another CPU would take."""
    flags = [f for f in gguf_kernel.CFLAGS if f != "-march=native"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags += ["-mno-avx2", "-mno-fma", "-mno-f16c"]
    library = ctypes.CDLL(str(cbuild.build(gguf_kernel.SOURCE, tuple(flags), cbuild.find_compiler())))
    kernel = GGUFKernel(library, 2)
    assert not kernel.simd
    return kernel


@pytest.fixture(scope="module")
def avx2_kernel() -> GGUFKernel:
    """The kernel built without AVX-512: the AVX2 loops an AVX2-only CPU takes (this CPU may have AVX-512)."""
    if platform.machine() not in ("x86_64", "AMD64") or not get_kernel().simd:
        pytest.skip("no AVX2 build on this machine")
    flags = (*gguf_kernel.CFLAGS, "-mno-avx512f")
    library = ctypes.CDLL(str(cbuild.build(gguf_kernel.SOURCE, flags, cbuild.find_compiler())))
    assert library.gguf_avx512() == 0
    return GGUFKernel(library, 2)


def test_the_native_build_takes_the_avx512_loop_where_the_cpu_has_it():
    """So that the native cases below check the AVX-512 loop on such a CPU (and the avx2 cases the AVX2 loop)."""
    flags = cbuild.cpu_flags().split()
    has_avx512 = all(f in flags for f in ("avx512f", "avx512bw", "avx512vl"))
    assert get_kernel()._lib.gguf_avx512() == int(has_avx512 and get_kernel().simd)


def kernels(portable: bool, request) -> GGUFKernel:
    return request.getfixturevalue("portable_kernel") if portable else get_kernel()


# (rows of W, blocks a row): odd, not multiples of the 8-row chunks; 11 blocks of 32 weights is
# one group of 256 and a partial one
SHAPES = [(1, 1), (37, 3), (9, 11), (129, 5)]


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dequantize_equals_gguf_to_the_bit(ggml_type, shape, portable, request):
    rows, blocks = shape
    packed = packed_weight(ggml_type, rows, blocks, seed=rows)
    expected = quants.dequantize(packed, ggml_type)
    kernel = kernels(portable, request)
    got = kernel.dequantize(int(ggml_type), torch.from_numpy(packed), expected.shape[1])
    np.testing.assert_array_equal(got.numpy(), expected)
    picked = torch.tensor([rows - 1, 0, rows // 2, rows - 1])
    got_rows = kernel.dequantize(int(ggml_type), torch.from_numpy(packed), expected.shape[1], picked)
    np.testing.assert_array_equal(got_rows.numpy(), got.numpy()[picked.numpy()])


# 1-4: tiles of 1-4 rows; 8: two tiles of 4; 9, 20, 64, 65: tiles of 8 rows, then the rest
NUM_ROWS = [1, 2, 3, 4, 5, 8, 9, 20, 64, 65]


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
@pytest.mark.parametrize("num_rows", NUM_ROWS)
def test_matmul_equals_dequantized_weight(ggml_type, shape, num_rows, build, request):
    """x @ W.T through the fused kernel, every row-tile size, the native build (AVX-512 where the CPU
    has it) and the AVX2-only one."""
    kernel = get_kernel() if build == "native" else request.getfixturevalue("avx2_kernel")
    rows, blocks = shape
    packed = packed_weight(ggml_type, rows, blocks, seed=rows + 1)
    weight = torch.from_numpy(quants.dequantize(packed, ggml_type))
    x = torch.randn(num_rows, weight.shape[1], generator=torch.Generator().manual_seed(num_rows))
    assert_matmul_close(kernel.matmul(int(ggml_type), torch.from_numpy(packed), weight.shape[1], x), x, weight)


def test_torchs_openmp_team_and_our_thread_pool_give_the_same_bits():
    """The native kernel runs on torch's OpenMP team where its -fopenmp build shares torch's
    runtime (this machine: torch's libgomp.so.1), else on a pthread pool of its own: each row of y
    is one thread's either way, so the two give the same bits."""
    native = get_kernel()
    assert native.openmp == cbuild.load_openmp(gguf_kernel.SOURCE, gguf_kernel.CFLAGS, "GGUF kernel")[1]
    if len(cbuild._openmp_runtimes()) == 1 and "libgomp" in next(iter(cbuild._openmp_runtimes())):
        assert native.openmp, "torch's one runtime is libgomp.so.1: the kernel should share its team"
    pool = GGUFKernel(cbuild.load(gguf_kernel.SOURCE, gguf_kernel.CFLAGS, "GGUF kernel"), 2, openmp=False)
    assert not pool.openmp and pool.num_threads == 2
    for ggml_type in (T.Q4_1, T.Q4_K, T.Q6_K):
        blocks = packed_weight(ggml_type, 301, 3, seed=7)
        packed, k = torch.from_numpy(blocks), quants.dequantize(blocks, ggml_type).shape[1]
        for num_rows in (1, 9, 40):
            x = torch.randn(num_rows, k, generator=torch.Generator().manual_seed(num_rows))
            got, want = (kernel.matmul(int(ggml_type), packed, k, x) for kernel in (native, pool))
            torch.testing.assert_close(got, want, atol=0, rtol=0)
        got, want = (kernel.dequantize(int(ggml_type), packed, k) for kernel in (native, pool))
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_rows", [1, 3, 9])
def test_portable_matmul_equals_dequantized_weight(ggml_type, num_rows, portable_kernel):
    packed = packed_weight(ggml_type, 37, 3, seed=5)
    weight = torch.from_numpy(quants.dequantize(packed, ggml_type))
    x = torch.randn(num_rows, weight.shape[1])
    assert_matmul_close(portable_kernel.matmul(int(ggml_type), torch.from_numpy(packed), weight.shape[1], x), x, weight)


@pytest.mark.parametrize("num_rows", [1, 3, 5, 9, 20])
def test_matmul_into_writes_its_columns_of_a_wider_output_in_place(num_rows):
    """A merged q/k/v whose parts have different types: each segment into its columns of one y, nothing else touched."""
    parts = [(T.Q4_K, packed_weight(T.Q4_K, 24, 2, 1)), (T.Q6_K, packed_weight(T.Q6_K, 8, 2, 2)),
             (T.Q5_0, packed_weight(T.Q5_0, 8, 16, 3))]
    x = torch.randn(num_rows, 512)
    y = torch.full((num_rows, 50), float("nan"))  # 40 columns of outputs, then 10 that must stay untouched
    start = 0
    for ggml_type, packed in parts:
        columns = y[:, start : start + packed.shape[0]]
        get_kernel().matmul_into(int(ggml_type), torch.from_numpy(packed), 512, x, columns)
        start += packed.shape[0]
    weight = torch.cat([torch.from_numpy(quants.dequantize(p, t)) for t, p in parts])
    assert_matmul_close(y[:, :40], x, weight)
    assert torch.isnan(y[:, 40:]).all()


def test_matmul_into_refuses_an_output_whose_rows_are_not_contiguous():
    packed = torch.from_numpy(packed_weight(T.Q4_K, 8, 1, 0))
    with pytest.raises(ValueError, match="out: need a float32"):
        get_kernel().matmul_into(int(T.Q4_K), packed, 256, torch.randn(3, 256), torch.empty(8, 3).t())


SEGMENTS = {
    "q4_1-q8_0-q4_0": [(T.Q4_1, 16), (T.Q8_0, 8), (T.Q4_0, 8)],
    "q4_k-q6_k": [(T.Q4_K, 24), (T.Q6_K, 8)],  # a Q4_K_M q/k/v: q and k in Q4_K, v in Q6_K
}


@pytest.mark.parametrize("segments", SEGMENTS.values(), ids=SEGMENTS.keys())
@pytest.mark.parametrize("tile_rows", [None, 5], ids=["whole-segments", "tiles-of-5-rows"])
@pytest.mark.parametrize("num_rows", [1, 9, gguf_linear.FUSED_MAX_ROWS + 3])
def test_linear_segments_bias_and_both_paths(segments, num_rows, tile_rows, monkeypatch):
    """Parts of different types in one module (q/k/v), a bias, the fused path and dequantize + GEMM (by tiles)."""
    in_features = 512
    if tile_rows:
        monkeypatch.setattr(gguf_linear, "DEQUANT_TILE_BYTES", tile_rows * in_features * 4)
    parts = [(t, packed_weight(t, rows, in_features // GGML_QUANT_SIZES[t][0], i))
             for i, (t, rows) in enumerate(segments)]
    weight = torch.cat([torch.from_numpy(quants.dequantize(p, t)) for t, p in parts])
    bias = torch.randn(weight.shape[0])
    linear = GGUFLinear(get_kernel(), in_features, [(int(t), torch.from_numpy(p)) for t, p in parts], bias)
    x = torch.randn(num_rows, in_features)
    assert_matmul_close(linear(x) - bias, x, weight)
    assert torch.equal(linear.dequantize(), weight)


def test_unsupported_shapes_and_types_are_refused():
    kernel = get_kernel()
    assert not kernel.supports(int(T.F16), 256)  # float tensors: the loader makes float32 parameters of them
    assert not kernel.supports(int(T.IQ4_XS), 256)  # no kernel: the loader dequantizes such tensors
    assert not kernel.supports(int(T.Q4_K), 128)  # rows of whole 256-weight blocks only
    assert not kernel.supports(int(T.Q5_0), 48)
    assert all(kernel.supports(int(t), 512) for t in TYPES)
