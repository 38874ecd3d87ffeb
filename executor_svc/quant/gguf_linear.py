"""Linear layers and embeddings whose weight stays in GGUF blocks (CPU, float32 activations).

A `GGUFLinear` holds its weight as one or more row segments, each a uint8 tensor
[rows, row_bytes] of one GGML block type (a merged q/k/v projection whose parts were
quantized to different types keeps three segments). Per call it picks by the number of
rows of x, as measured on this machine (`bench/bench_gguf_matmul.py`):

- few rows (decode steps): the fused kernel, which reads each block once and never
  writes a float32 weight;
- many rows (prefill chunks): the weight dequantized into float32 (the kernel, vectorised)
  and one GEMM, which is compute-bound and far faster there than the fused loop.

Either way the numbers are those of the dequantized weight times x in float32, as
transformers computes them after dequantizing the same file (only the summation order
differs).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.quant.gguf_kernel import GGUFKernel

# Above this many rows of x, dequantize + GEMM beats the fused kernel (measured on 2 cores, AVX2:
# see bench/bench_gguf_matmul.py). PAGODA_GGUF_FUSED_MAX_ROWS overrides it for side-by-side runs.
FUSED_MAX_ROWS = int(os.environ.get("PAGODA_GGUF_FUSED_MAX_ROWS", "32"))


class GGUFLinear(nn.Module):
    """y = x @ W.T (+ bias) with W in GGUF blocks; `segments` are (ggml_type, uint8 [rows, row_bytes])."""

    def __init__(
        self, kernel: GGUFKernel, in_features: int, segments: list[tuple[int, torch.Tensor]], bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.kernel = kernel
        self.in_features = in_features
        self.types = [t for t, _ in segments]
        for i, (_, packed) in enumerate(segments):
            self.register_buffer(f"packed{i}", packed)
        self.out_features = sum(p.shape[0] for _, p in segments)
        self.register_buffer("bias", bias)

    @property
    def segments(self) -> list[tuple[int, torch.Tensor]]:
        return [(t, getattr(self, f"packed{i}")) for i, t in enumerate(self.types)]

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight (or its rows `rows`, int64, of a one-segment weight)."""
        if rows is not None:
            (ggml_type, packed), = self.segments
            return self.kernel.dequantize(ggml_type, packed, self.in_features, rows)
        parts = [self.kernel.dequantize(t, p, self.in_features) for t, p in self.segments]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            len(self.types) == 1 and x.dim() == 2 and x.shape[0] <= FUSED_MAX_ROWS and x.dtype == torch.float32
            and x.is_contiguous()
        ):
            # a decode step's shape: one kernel call and nothing else (each torch op or list built
            # here costs about a microsecond, against 20-60 us for the call at one row)
            y = self.kernel.matmul(self.types[0], self.packed0, self.in_features, x)
            if self.bias is not None:
                y += self.bias
            return y
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features).float().contiguous()
        if x.shape[0] > FUSED_MAX_ROWS:
            y = F.linear(x, self.dequantize(), self.bias)
        else:
            parts = [self.kernel.matmul(t, p, self.in_features, x) for t, p in self.segments]
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
            if self.bias is not None:
                y += self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, types={self.types}"


class GGUFEmbedding(nn.Module):
    """Token embedding read from GGUF blocks: only the looked-up rows are dequantized.

    With tied embeddings the same module is the LM head (`as_linear`): one copy of the blocks.
    """

    def __init__(self, linear: GGUFLinear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.linear.dequantize(input_ids.long().contiguous())


def packed_rows(parts: list[np.ndarray]) -> torch.Tensor:
    """Block rows (a GGUF reader's memory-mapped arrays) stacked into one uint8 tensor we own, copied once."""
    out = torch.empty(sum(p.shape[0] for p in parts), parts[0].shape[1], dtype=torch.uint8)
    start = 0
    for part in parts:
        out[start : start + part.shape[0]] = torch.from_numpy(np.ascontiguousarray(part).view(np.uint8))
        start += part.shape[0]
    return out
