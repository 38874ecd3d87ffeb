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
    runtimes = cbuild._openmp_runtimes()
    # A fresh load decides as the kernel's did only while torch's runtime is the process's one: in the
    # whole suite an earlier test's import of sentence-transformers maps scikit-learn's own libgomp
    # (the executor imports neither), and a load after that rightly declines torch's team.
    if len(runtimes) == 1:
        assert native.openmp == cbuild.load_openmp(gguf_kernel.SOURCE, gguf_kernel.CFLAGS, "GGUF kernel")[1]
        if "libgomp" in next(iter(runtimes)):
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


# -- opt-in int8 activations (`--gguf-int8-activations`): Q5_0, Q4_K and Q6_K against rows of x


@pytest.fixture
def int8_x():
    """The native kernel with int8 activations on (skipped where its build has no int8 loop: no AVX2); off after."""
    kernel = get_kernel()
    if not kernel.int8_activations_supported:
        pytest.skip("no int8 loop in this build (no AVX2)")
    assert not kernel.int8_activations  # off unless asked for
    assert kernel.set_int8_activations(True)
    yield kernel
    kernel.set_int8_activations(False)


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it: per block of 32, int8 q = round-half-even(x * 127 / max|x|), times max|x| / 127."""
    blocks = x.view(-1, 32)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv).clamp(-128, 127)  # (float32 products, as the kernel's; torch.round: half to even)
    return (q.double() * (amax / 127.0).double()).view_as(x)


INT8_TYPES = (T.Q5_0, T.Q4_K, T.Q6_K)  # the types whose matmuls take int8 activations


@pytest.mark.parametrize("ggml_type", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
def test_int8_activations_one_row_is_the_rounded_x_times_the_weight(ggml_type, shape, int8_x):
    """The int8 loop computes exactly the product of the rounded x (its int8 dot products are exact;
    only the float32 scaling and summation order differ), and that stays within 1 % of the float32
    product (Q5_0: measured 0.49-0.56 % relative error on 2,048 x 640 and 640 x 2,048)."""
    rows, blocks = shape
    packed = packed_weight(ggml_type, rows, blocks, seed=rows + 3)
    weight = torch.from_numpy(quants.dequantize(packed, ggml_type))
    x = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(rows))
    got = int8_x.matmul(int(ggml_type), torch.from_numpy(packed), weight.shape[1], x)
    assert_matmul_close(got, int8_rounded(x).float(), weight)
    exact = x.double() @ weight.double().T
    assert ((got.double() - exact).norm() / exact.norm()).item() <= 0.01
    int8_x.set_int8_activations(False)
    float_x = int8_x.matmul(int(ggml_type), torch.from_numpy(packed), weight.shape[1], x)
    int8_x.set_int8_activations(True)
    assert not torch.equal(got, float_x)  # (the int8 loop did run)


@pytest.mark.parametrize(
    ("ggml_type", "num_rows"),
    [(t, m) for t in TYPES for m in (1, 2, 9) if t not in INT8_TYPES],
    ids=lambda v: v.name if isinstance(v, T) else str(v),
)
def test_int8_activations_leave_other_types_to_the_bit(ggml_type, num_rows, int8_x):
    """Only Q5_0, Q4_K and Q6_K take int8 activations: every other type gives, at every row count, the bits it
    gives with them off."""
    packed = torch.from_numpy(packed_weight(ggml_type, 37, 11 if ggml_type in QUANTIZABLE else 2, seed=7))
    in_features = packed.shape[1] // GGML_QUANT_SIZES[ggml_type][1] * GGML_QUANT_SIZES[ggml_type][0]
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(3))
    on = int8_x.matmul(int(ggml_type), packed, in_features, x)
    int8_x.set_int8_activations(False)
    off = int8_x.matmul(int(ggml_type), packed, in_features, x)
    int8_x.set_int8_activations(True)
    assert torch.equal(on, off)


def int8_rows_case(ggml_type, num_rows: int, seed: int):
    rows, blocks = 37, 12 if ggml_type == T.Q5_0 else 3
    packed = torch.from_numpy(packed_weight(ggml_type, rows, blocks, seed=seed))
    weight = torch.from_numpy(quants.dequantize(packed.numpy(), ggml_type))
    x = torch.randn(num_rows, weight.shape[1], generator=torch.Generator().manual_seed(seed)) * 2
    return packed, weight, x


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("num_rows", [2, 4, 7, 9])
@pytest.mark.parametrize("ggml_type", INT8_TYPES, ids=lambda t: t.name)
def test_int8_activations_rows_of_x_are_each_the_one_row_product(ggml_type, num_rows, build, request):
    """Several rows of x (prefill chunks, batched decodes) take the int8 loops too, 4 rows of x a pass over a
    weight row (gguf_q8_rows.h; 7 and 9 leave partial passes): each row of the product is the bits the one-row
    loop gives for that row alone (Q6_K: the same integers, other float roundings: the offset is taken a group
    at a time), the product of the rounded x, within 1 % of float32 x's."""
    kernel = get_kernel() if build == "native" else request.getfixturevalue("avx2_kernel")
    if not kernel.int8_activations_supported:
        pytest.skip("no int8 loop in this build (no AVX2)")
    packed, weight, x = int8_rows_case(ggml_type, num_rows, seed=num_rows + 20)
    assert kernel.set_int8_activations(True)
    try:
        got = kernel.matmul(int(ggml_type), packed, weight.shape[1], x)
        k = weight.shape[1]
        one = [kernel.matmul(int(ggml_type), packed, k, x[m : m + 1].contiguous()) for m in range(num_rows)]
    finally:
        kernel.set_int8_activations(False)
    if ggml_type == T.Q6_K:
        assert_matmul_close(torch.cat(one), int8_rounded(x).float(), weight)
    else:
        assert torch.equal(got, torch.cat(one))
    assert_matmul_close(got, int8_rounded(x).float(), weight)
    exact = x.double() @ weight.double().T
    assert ((got.double() - exact).norm() / exact.norm()).item() <= 0.01
    assert not torch.equal(got, kernel.matmul(int(ggml_type), packed, weight.shape[1], x))  # (int8 ran)


@pytest.mark.parametrize("ggml_type", INT8_TYPES, ids=lambda t: t.name)
def test_int8_activations_take_prompt_rows_in_a_linear(ggml_type, int8_x):
    """A GGUFLinear of int8 types sends rows of x above its fused threshold, up to INT8_MAX_ROWS, to the
    int8 loops, not to dequantize + GEMM (faster there, and a prompt chunk's rows get the numbers its decode
    steps get); more rows, or a linear with a type of no int8 loop, keep dequantize + GEMM."""
    from executor_svc.quant.gguf_linear import INT8_MAX_ROWS, GGUFLinear

    packed, weight, x = int8_rows_case(ggml_type, 11, seed=4)
    linear = GGUFLinear(int8_x, weight.shape[1], [(int(ggml_type), packed)], None)
    linear.set_row_thresholds(4, 4)
    got = linear(x)
    assert torch.equal(got, int8_x.matmul(int(ggml_type), packed, weight.shape[1], x))
    assert_matmul_close(got, int8_rounded(x).float(), weight)
    many = torch.randn(INT8_MAX_ROWS + 1, weight.shape[1], generator=torch.Generator().manual_seed(6))
    assert_matmul_close(linear(many), many, weight)  # float32 x: dequantize + GEMM
    q8 = torch.from_numpy(packed_weight(T.Q8_0, 37, weight.shape[1] // 32, seed=4))
    other = GGUFLinear(int8_x, weight.shape[1], [(int(ggml_type), packed), (int(T.Q8_0), q8)], None)
    other.set_row_thresholds(4, 4)
    assert not int8_x.takes_int8(other.types, weight.shape[1])
    both = torch.cat([weight, torch.from_numpy(quants.dequantize(q8.numpy(), T.Q8_0))])
    assert_matmul_close(other(x), x, both)  # float32 x: dequantize + GEMM


@pytest.mark.parametrize("ggml_type", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_int8_activations_keep_a_non_finite_x_non_finite(ggml_type, bad, int8_x):
    """A NaN or infinity in x gives non-finite outputs, as float32 x does (the runner then fails that
    request alone), not int8 garbage that looks finite."""
    packed = packed_weight(ggml_type, 9, 4 if ggml_type == T.Q5_0 else 1, seed=5)
    in_features = 128 if ggml_type == T.Q5_0 else 256
    x = torch.randn(1, in_features, generator=torch.Generator().manual_seed(1))
    x[0, 70] = bad
    got = int8_x.matmul(int(ggml_type), torch.from_numpy(packed), in_features, x)
    assert not torch.isfinite(got).any()


@pytest.mark.parametrize("ggml_type", INT8_TYPES, ids=lambda t: t.name)
def test_int8_activations_of_the_avx2_build(ggml_type, avx2_kernel):
    """The AVX2 build's int8 loops (vpmaddubsw + vpmaddwd for vpdpbusd, gguf_avx2_q8.h), which a CPU without
    AVX-512 VNNI takes: the product of the rounded x, within 1 % of float32 x's, as the native build's."""
    rows, blocks = 129, 12 if ggml_type == T.Q5_0 else 3
    packed = packed_weight(ggml_type, rows, blocks, seed=11)
    weight = torch.from_numpy(quants.dequantize(packed, ggml_type))
    x = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(5)) * 3
    assert avx2_kernel.int8_activations_supported and avx2_kernel.set_int8_activations(True)
    try:
        got = avx2_kernel.matmul(int(ggml_type), torch.from_numpy(packed), weight.shape[1], x)
    finally:
        avx2_kernel.set_int8_activations(False)
    assert_matmul_close(got, int8_rounded(x).float(), weight)
    exact = x.double() @ weight.double().T
    assert ((got.double() - exact).norm() / exact.norm()).item() <= 0.01
    assert not torch.equal(got, avx2_kernel.matmul(int(ggml_type), torch.from_numpy(packed), weight.shape[1], x))


# -- Q5_0 against one row of x, x as three int8 digits (the default where the build has AVX-512 VNNI)


@pytest.fixture
def digits():
    """The native kernel, whose Q5_0 one-row matmul takes x as digits (skipped where its build has no VNNI loop)."""
    kernel = get_kernel()
    if not kernel.digit_activations:
        pytest.skip("this build has no AVX-512 VNNI loop")
    yield kernel
    kernel.set_digit_activations(True)


def relative_error(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> float:
    """The largest |got - x @ weight.T| (float64) against sum |x w|, output by output."""
    exact = x.double() @ weight.double().T
    scale = x.abs().double() @ weight.abs().double().T
    return ((got.double() - exact).abs() / scale).max().item()


@pytest.mark.parametrize("shape", [(37, 3), (129, 5), (256, 20), (40, 64)], ids=str)
@pytest.mark.parametrize("x_kind", ["normal", "outliers", "tiny", "huge"])
def test_q5_0_one_row_with_x_as_digits_is_float32_grade(shape, x_kind, digits):
    """x rounded to 22 bits against the largest |x| of its 4, the products and sums exact in int32: within
    1e-6 of sum |x w| of the float64 product (measured 3-6e-8 for normal x, 2-3e-7 with outliers; the float
    loop 2-3e-8 and 1.5-1.7e-7; int8 activations ~5e-3), whatever the scale of x."""
    rows, blocks = shape
    packed = packed_weight(T.Q5_0, rows, blocks, seed=rows)
    weight = torch.from_numpy(quants.dequantize(packed, T.Q5_0))
    g = torch.Generator().manual_seed(blocks)
    x = torch.randn(1, weight.shape[1], generator=g)
    if x_kind == "outliers":  # a few channels far above the rest, as LLM activations have
        x = x * torch.where(torch.rand(1, weight.shape[1], generator=g) < 0.02, 300.0, 1.0)
    x = x * {"tiny": 1e-30, "huge": 1e30}.get(x_kind, 1.0)
    got = digits.matmul(int(T.Q5_0), torch.from_numpy(packed), weight.shape[1], x)
    assert relative_error(got, x, weight) <= 1e-6
    digits.set_digit_activations(False)
    float_loop = digits.matmul(int(T.Q5_0), torch.from_numpy(packed), weight.shape[1], x)
    assert relative_error(float_loop, x, weight) <= 1e-6
    assert not torch.equal(got, float_loop)  # (the digits did run)


def test_q5_0_digits_keep_zeros_zero_and_non_finite_x_non_finite(digits):
    """An all-zero x gives exact zeros; a NaN or an infinity gives non-finite outputs, as float32 x does."""
    packed = torch.from_numpy(packed_weight(T.Q5_0, 9, 4, seed=5))
    assert torch.equal(digits.matmul(int(T.Q5_0), packed, 128, torch.zeros(1, 128)), torch.zeros(1, 9))
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(1, 128, generator=torch.Generator().manual_seed(1))
        x[0, 70] = bad
        assert not torch.isfinite(digits.matmul(int(T.Q5_0), packed, 128, x)).any()


@pytest.mark.parametrize(
    ("ggml_type", "num_rows"),
    [(t, m) for t in TYPES for m in (1, 2, 9) if not (t == T.Q5_0 and m == 1)],
    ids=lambda v: v.name if isinstance(v, T) else str(v),
)
def test_digits_leave_other_types_and_rows_to_the_bit(ggml_type, num_rows, digits):
    """Only Q5_0 at one row of x takes x as digits."""
    packed = torch.from_numpy(packed_weight(ggml_type, 37, 11 if ggml_type in QUANTIZABLE else 2, seed=7))
    in_features = packed.shape[1] // GGML_QUANT_SIZES[ggml_type][1] * GGML_QUANT_SIZES[ggml_type][0]
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(3))
    on = digits.matmul(int(ggml_type), packed, in_features, x)
    digits.set_digit_activations(False)
    assert torch.equal(on, digits.matmul(int(ggml_type), packed, in_features, x))


def test_int8_activations_take_precedence_over_digits(int8_x):
    """With `--gguf-int8-activations` a Q5_0 one-row matmul is the int8 loop's, digits on or off."""
    packed = torch.from_numpy(packed_weight(T.Q5_0, 37, 3, seed=2))
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(4))
    on = int8_x.matmul(int(T.Q5_0), packed, 96, x)
    int8_x.set_digit_activations(False)
    off = int8_x.matmul(int(T.Q5_0), packed, 96, x)
    int8_x.set_digit_activations(True)
    assert torch.equal(on, off)


def test_a_build_without_vnni_keeps_the_float_loop(avx2_kernel):
    assert not avx2_kernel.digit_activations
    assert not avx2_kernel.set_digit_activations(True)
