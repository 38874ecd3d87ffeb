"""GGUF blocks for tests: quantized by the `gguf` package where it can, else random bytes with sane scales.

The `gguf` package quantizes Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 but not the K-quants; every bit pattern of
a K-quant block's quants and packed sub-scales is a valid block, so random bytes with finite
fp16 super-block scales stand in for them.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

T = GGMLQuantizationType
QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
# byte offsets of each K-quant block's fp16 scales (d, dmin)
K_QUANT_SCALES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(
    ggml_type: GGMLQuantizationType, rows: int, blocks: int, seed: int, scale: float = 0.05
) -> np.ndarray:
    """[rows, blocks * block_bytes] uint8: `blocks` blocks a row, from random floats (times `scale`
    for the quantizable types) or random bytes whose fp16 scales are uniform in +-`scale`."""
    rng = np.random.default_rng(seed)
    block_weights, block_bytes = GGML_QUANT_SIZES[ggml_type]
    if ggml_type in QUANTIZABLE:
        floats = (scale * rng.standard_normal((rows, blocks * block_weights))).astype(np.float32)
        return quants.quantize(floats, ggml_type)
    data = rng.integers(0, 256, (rows, blocks, block_bytes), dtype=np.uint8)
    for offset in K_QUANT_SCALES[ggml_type]:
        scales = rng.uniform(-scale, scale, (rows, blocks)).astype(np.float16)
        data[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, blocks, 2)
    return data.reshape(rows, blocks * block_bytes)


def assert_matmul_close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """`got` is x @ weight.T within float32 summation-order error of the float64 product (the bound
    grows with sum |x w|, as the error of any float32 order of the sum does)."""
    expected = (x.double() @ weight.double().T).float()
    scale = (x.abs().double() @ weight.abs().double().T).float()
    assert torch.all((got - expected).abs() <= 1e-5 * scale + 1e-6), (got - expected).abs().max()
