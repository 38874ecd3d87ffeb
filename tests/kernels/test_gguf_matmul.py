"""The GGUF kernel against the `gguf` package's own dequantization, every supported block type, odd shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from executor_svc.quant import gguf_linear
from executor_svc.quant.gguf_kernel import get_kernel
from executor_svc.quant.gguf_linear import GGUFLinear

T = GGMLQuantizationType
SIMPLE = (T.Q4_0, T.Q4_1, T.Q8_0)  # the gguf package can quantize these
K_QUANTS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}  # byte offsets of each block's fp16 scales

pytestmark = pytest.mark.skipif(get_kernel() is None, reason="no C compiler: the GGUF kernel is not built")


def packed_weight(ggml_type: GGMLQuantizationType, rows: int, blocks: int, seed: int) -> np.ndarray:
    """[rows, row_bytes] blocks: quantized from random floats, or (K-quants) random bytes with sane scales."""
    rng = np.random.default_rng(seed)
    block_weights, block_bytes = GGML_QUANT_SIZES[ggml_type]
    if ggml_type in SIMPLE:
        return quants.quantize(rng.standard_normal((rows, blocks * block_weights)).astype(np.float32), ggml_type)
    data = rng.integers(0, 256, (rows, blocks, block_bytes), dtype=np.uint8)
    for offset in K_QUANTS[ggml_type]:
        scales = rng.uniform(-0.05, 0.05, (rows, blocks)).astype(np.float16)
        data[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, blocks, 2)
    return data.reshape(rows, blocks * block_bytes)


TYPES = [*SIMPLE, *K_QUANTS]
SHAPES = [(1, 1), (37, 3), (129, 5)]  # (rows of W, blocks a row): odd, not a multiple of the 8-row chunks


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dequantize_equals_gguf(ggml_type, shape):
    rows, blocks = shape
    packed = packed_weight(ggml_type, rows, blocks, seed=rows)
    expected = quants.dequantize(packed, ggml_type)
    kernel = get_kernel()
    got = kernel.dequantize(int(ggml_type), torch.from_numpy(packed), expected.shape[1])
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-7)
    picked = torch.tensor([rows - 1, 0, rows // 2, rows - 1])
    got_rows = kernel.dequantize(int(ggml_type), torch.from_numpy(packed), expected.shape[1], picked)
    np.testing.assert_array_equal(got_rows.numpy(), got.numpy()[picked.numpy()])


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 9, 20])  # 9, 20: tiles of 8 rows, then the rest
def test_matmul_equals_dequantized_weight(ggml_type, shape, num_rows):
    """x @ W.T through the fused kernel, every row-tile size, within float32 summation-order error."""
    rows, blocks = shape
    packed = packed_weight(ggml_type, rows, blocks, seed=rows + 1)
    weight = torch.from_numpy(quants.dequantize(packed, ggml_type))
    x = torch.randn(num_rows, weight.shape[1], generator=torch.Generator().manual_seed(num_rows))
    got = get_kernel().matmul(int(ggml_type), torch.from_numpy(packed), weight.shape[1], x)
    expected = (x.double() @ weight.double().T).float()
    scale = (x.abs().double() @ weight.abs().double().T).float()  # the error bound grows with sum |x w|
    assert torch.all((got - expected).abs() <= 1e-5 * scale + 1e-6)


@pytest.mark.parametrize("tile_rows", [None, 5], ids=["whole-segments", "tiles-of-5-rows"])
@pytest.mark.parametrize("num_rows", [1, gguf_linear.FUSED_MAX_ROWS + 3])
def test_linear_segments_bias_and_both_paths(num_rows, tile_rows, monkeypatch):
    """Parts of different types in one module (q/k/v), a bias, the fused path and dequantize + GEMM (by tiles)."""
    if tile_rows:
        monkeypatch.setattr(gguf_linear, "DEQUANT_TILE_BYTES", tile_rows * 128 * 4)
    parts = [packed_weight(T.Q4_1, 16, 4, 1), packed_weight(T.Q8_0, 8, 4, 2), packed_weight(T.Q4_0, 8, 4, 3)]
    kinds = [T.Q4_1, T.Q8_0, T.Q4_0]
    weight = torch.cat([torch.from_numpy(quants.dequantize(p, t)) for p, t in zip(parts, kinds)])
    bias = torch.randn(32)
    linear = GGUFLinear(get_kernel(), 128, [(int(t), torch.from_numpy(p)) for p, t in zip(parts, kinds)], bias)
    x = torch.randn(num_rows, 128)
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(linear.dequantize(), weight)


def test_unsupported_shapes_and_types_are_refused():
    kernel = get_kernel()
    assert not kernel.supports(int(T.Q5_0), 256)  # no kernel: the loader dequantizes such tensors
    assert not kernel.supports(int(T.F16), 256)
    assert not kernel.supports(int(T.Q4_0), kernel.max_k + 32)
    assert kernel.supports(int(T.Q4_K), 512)
