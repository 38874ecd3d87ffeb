"""Linear layers and embeddings whose weight stays in GGUF blocks (CPU, float32 or bfloat16 activations).

A `GGUFLinear` holds its weight as one or more row segments, each a uint8 tensor
[rows, row_bytes] of one GGML block type (a merged q/k/v projection whose parts were
quantized to different types keeps three segments). Per call it picks by the number of
rows of x, as measured on this machine (the note of #18):

- few rows (decode steps): the fused kernel, which reads each block once and never
  writes a float32 weight;
- many rows (prefill chunks): the weight dequantized into float32 (the kernel, vectorised)
  and one GEMM, which is compute-bound and far faster there than the fused loop; with
  `--gguf-int8-activations`, Q5_0 / Q4_K / Q6_K weights take the kernel's int8 loops up to
  `INT8_MAX_ROWS` rows instead (faster than the float32 GEMM there: see `GGUFKernel.takes_int8`).

Either way the numbers are those of the dequantized weight times x in float32, as
transformers computes them after dequantizing the same file (only the summation order
differs).

bfloat16 activations (a `--dtype bfloat16` model) take the same two routes, with another
threshold (`BF16_FUSED_MAX_ROWS`): few rows go through the fused kernel in float32 (x cast
in, y cast out: the weight is never rounded); more rows dequantize a tile of the weight
into float32, round it to bfloat16 (the weight transformers holds after loading the file
in bfloat16) and multiply in bfloat16 with float32 accumulation (oneDNN). The weight stays
in its blocks: no bfloat16 copy is kept (see `BF16_FUSED_MAX_ROWS` for the figures).
"""

from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.model import can_pack_for_cpu
from executor_svc.quant.gguf_kernel import GGUFKernel

# Above this many rows of x, dequantize + GEMM beats the fused kernel (measured on 2 cores, AVX2,
# the default model's 120 decoder linears: fused 25 / 49 / 74 / 97 / 192 ms at 16 / 32 / 48 /
# 64 / 128 rows, dequantize + GEMM 73 / 85 / 89 / 108 / 144 ms; the note of #18).
# The default of `BackendOptions.gguf_fused_max_rows` (PAGODA_GGUF_FUSED_MAX_ROWS for side-by-side runs).
FUSED_MAX_ROWS = 64

# With `--gguf-int8-activations`, Q5_0 / Q4_K / Q6_K weights take the int8 loops up to this many rows, then
# dequantize + GEMM. GFLOP/s on 2 threads of an AVX2 AMD EPYC (`bench/bench_gguf_matmul.py --int8-rows`),
# int8 / dequantize + GEMM: 128 rows Q4_K 16,384 x 2,048 95.5 / 62.5, Q4_K 2,048 x 8,192 90.6 / 75.4, Q6_K
# 2,048 x 8,192 74.5 / 82.5; 256 rows 81.3 / 66.4, 95.3 / 111.2, 74.7 / 99.1; 512 rows 79.5 / 64.1,
# 87.0 / 115.1, 64.9 / 100.7 (the int8 loops read each row's x again for every weight row; the GEMM blocks).
INT8_MAX_ROWS = 128

# bfloat16 x: above this many rows, dequantize a tile into bfloat16 + a bfloat16 GEMM beats the
# fused float32 kernel. Measured on an AMD EPYC (AVX-512 BF16, no AMX), one thread, the default
# model's four layer-0 linears together, ms, bfloat16 dequantize + GEMM / fused (x cast in, y out):
#   rows 1: 2.32 / 0.38   8: 2.36 / 1.45   16: 2.74 / 2.12   24: 2.89 / 3.37   48: 4.33 / 6.66
#   rows 256: 11.9 / 34.4 (float32 dequantize + GEMM: 22.4)
# Dequantizing into bfloat16 is about 7 % of the GEMM at 256 rows (gate/up: 0.34 of 4.83 ms), so
# a bfloat16 copy of the weights (256.5 MiB for the default model's kept weights, 2.7x the 94 MiB
# its blocks take) would buy little. A weight of several tiles (the vocabulary-sized LM head,
# 49152 x 576 Q8_0) costs far more to dequantize per call and stays fused up to FUSED_MAX_ROWS
# rows (there, ms: rows 16: 43 / 17, 32: 50 / 31, 48: 49 / 52, 64: 59 / 60, 128: 77 / 127).
# The default of `BackendOptions.gguf_bf16_fused_max_rows` (PAGODA_GGUF_BF16_FUSED_MAX_ROWS for side-by-side runs).
BF16_FUSED_MAX_ROWS = 16
# The same where the linear keeps a bfloat16 copy of its weight (`keep_bf16_weight`, the
# executor's --gguf-bf16-weights): nothing to dequantize per call, so the GEMM wins sooner. A
# decode step of the default model through the C decode path (AMD EPYC, AVX-512 BF16, no AMX,
# 2 threads, 256 tokens of context; ms, fused up to 4 / 8 rows): rows 4: 14.9 / 14.6,
# 5: 20.9 / 20.8, 6: 21.7 / 22.6, 7: 24.4 / 25.3, 8: 24.3 / 26.3; fused up to 16: rows 12: 34.2
# against 27.8, 16: 42.4 against 32.8.
BF16_COPY_FUSED_MAX_ROWS = 5
# the row count oneDNN blocks a packed bfloat16 copy for (`keep_bf16_weight`): 16-256 measured alike
PACK_ROWS_HINT = 64

# The dequantize + GEMM path works a tile of weight rows this large (float32) at a time, in one
# buffer that is reused (see GGUFLinear._dequantized_gemm).
DEQUANT_TILE_BYTES = 16 << 20
_buffers = {torch.float32: torch.empty(0, dtype=torch.float32), torch.bfloat16: torch.empty(0, dtype=torch.bfloat16)}


def _dequant_buffer(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The process's dequantization buffer in `dtype`, at least `numel` values (one caller at a time, as the kernel)."""
    if _buffers[dtype].numel() < numel:
        _buffers[dtype] = torch.empty(numel, dtype=dtype)
    return _buffers[dtype]


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
        self.register_buffer("bf16_weight", None, persistent=False)  # see keep_bf16_weight
        self.set_row_thresholds(FUSED_MAX_ROWS, BF16_FUSED_MAX_ROWS)

    def keep_bf16_weight(self) -> None:
        """Hold a bfloat16 copy of the weight for bfloat16 x above the fused threshold: one GEMM a call,
        nothing dequantized per call (2 bytes a weight more; the blocks stay for the fused rows).

        Where oneDNN runs (torch's CPU build), the copy is reordered once into oneDNN's blocked
        layout, as `PackedLinear` does for unquantized weights: a plain bfloat16 weight is
        reordered again inside every `F.linear` call, which at decode-step rows is about as long
        as the product (`bench/bench_bf16.py --parts linears`). The packed copy gives the same
        outputs (`bf16_weight.to_dense()` is the plain copy)."""
        weight = self.dequantize().to(torch.bfloat16)
        if can_pack_for_cpu(weight.device, torch.bfloat16):
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        del self._buffers["bf16_weight"]  # a plain attribute: an opaque oneDNN tensor has no storage to count
        self.bf16_weight = weight
        self.set_row_thresholds(self.fused_max_rows, self._bf16_rows)

    def set_row_thresholds(self, fused_max_rows: int, bf16_fused_max_rows: int) -> None:
        """Up to how many rows of x the fused kernel runs (float32 x; bfloat16 x) before dequantize + GEMM.

        A weight of several dequantization tiles (the vocabulary-sized LM head) keeps the float32
        threshold for bfloat16 x too (see `BF16_FUSED_MAX_ROWS`), unless it keeps a bfloat16 copy."""
        cheap = 4 * self.in_features * self.out_features <= DEQUANT_TILE_BYTES or self.bf16_weight is not None
        self.fused_max_rows = fused_max_rows
        self._bf16_rows = bf16_fused_max_rows
        self.bf16_fused_max_rows = bf16_fused_max_rows if cheap else fused_max_rows

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
        if x.dtype == torch.bfloat16:
            return self._forward_bf16(x)
        if x.dim() == 2 and x.shape[0] <= self.fused_max_rows and x.dtype == torch.float32 and x.is_contiguous():
            return self._fused(x)  # a decode step's shape: no reshape, no copy
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features).float().contiguous()
        rows = x.shape[0]
        many = rows > self.fused_max_rows and not (
            rows <= INT8_MAX_ROWS and self.kernel.takes_int8(self.types, self.in_features)
        )
        y = self._dequantized_gemm(x) if many else self._fused(x)
        return y.reshape(*lead, self.out_features)

    def _forward_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """bfloat16 in and out: the fused kernel in float32 for few rows, else a bfloat16 GEMM."""
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if x.shape[0] <= self.bf16_fused_max_rows:
            y = self._fused(x.float().contiguous()).to(torch.bfloat16)
        elif self.bf16_weight is not None:
            bias = None if self.bias is None else self.bias.to(torch.bfloat16)
            if self.bf16_weight.is_mkldnn:
                y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.bf16_weight, bias, "none", [], "")
            else:
                y = F.linear(x, self.bf16_weight, bias)
        else:
            y = self._dequantized_gemm_bf16(x.contiguous())
        return y.reshape(*lead, self.out_features)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 contiguous through the fused kernel: one C call a segment and nothing else
        (each torch op or list built here costs about a microsecond, against 20-60 us for the call
        at one row); the segments of a merged projection (q/k Q4_K, v Q6_K) write their columns of
        y in place."""
        if len(self.types) == 1:
            y = self.kernel.matmul(self.types[0], self.packed0, self.in_features, x)
        else:
            y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
            start = 0
            for i, ggml_type in enumerate(self.types):
                packed = getattr(self, f"packed{i}")
                self.kernel.matmul_columns(ggml_type, packed, self.in_features, x, y, start)
                start += packed.shape[0]
        if self.bias is not None:
            y += self.bias
        return y

    def _dequantized_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T with W dequantized a tile of rows at a time into one reused buffer.

        A fresh float32 weight each call cost more than the GEMM at batch sizes of 33-64 rows:
        the allocator maps new pages for a tensor this size, and every page faults on its first
        write (1,700 faults for a 3072 x 576 weight, on every step; measured in the note of #18).
        """
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        rows_per_tile = max(1, DEQUANT_TILE_BYTES // (4 * self.in_features))
        buffer = _dequant_buffer(min(rows_per_tile, self.out_features) * self.in_features)
        start = 0
        for ggml_type, packed in self.segments:
            for n0 in range(0, packed.shape[0], rows_per_tile):
                tile = packed[n0 : n0 + rows_per_tile]
                w = buffer[: tile.shape[0] * self.in_features].view(tile.shape[0], self.in_features)
                self.kernel.dequantize(ggml_type, tile, self.in_features, out=w)
                if tile.shape[0] == self.out_features:  # the whole weight in one tile: straight into y
                    torch.mm(x, w.t(), out=y)
                else:
                    y[:, start : start + tile.shape[0]].copy_(torch.mm(x, w.t()))
                start += tile.shape[0]
        if self.bias is not None:
            y += self.bias
        return y

    def _dequantized_gemm_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bfloat16 @ W.T with W dequantized a tile at a time (float32, then rounded to
        bfloat16 into a second reused buffer); bfloat16 GEMM with float32 accumulation, bfloat16 out."""
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
        rows_per_tile = max(1, DEQUANT_TILE_BYTES // (4 * self.in_features))
        numel = min(rows_per_tile, self.out_features) * self.in_features
        buffer, buffer_bf16 = _dequant_buffer(numel), _dequant_buffer(numel, torch.bfloat16)
        start = 0
        for ggml_type, packed in self.segments:
            for n0 in range(0, packed.shape[0], rows_per_tile):
                tile = packed[n0 : n0 + rows_per_tile]
                shape = (tile.shape[0], self.in_features)
                w = buffer[: shape[0] * shape[1]].view(shape)
                self.kernel.dequantize(ggml_type, tile, self.in_features, out=w)
                w_bf16 = buffer_bf16[: shape[0] * shape[1]].view(shape)
                w_bf16.copy_(w)
                if tile.shape[0] == self.out_features:
                    torch.mm(x, w_bf16.t(), out=y)
                else:
                    y[:, start : start + tile.shape[0]].copy_(torch.mm(x, w_bf16.t()))
                start += tile.shape[0]
        if self.bias is not None:
            y += self.bias
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, types={self.types}"


class GGUFEmbedding(nn.Module):
    """Token embedding read from GGUF blocks: only the looked-up rows are dequantized.

    With tied embeddings the same module is the LM head (`as_linear`): one copy of the blocks.
    """

    def __init__(self, linear: GGUFLinear, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.linear = linear
        self.dtype = dtype  # the model's: rows are dequantized in float32, then cast

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.linear.dequantize(input_ids.long().contiguous()).to(self.dtype)


def packed_rows(parts: list[np.ndarray]) -> torch.Tensor:
    """Block rows (a GGUF reader's memory-mapped arrays) stacked into one uint8 tensor we own, copied once."""
    out = torch.empty(sum(p.shape[0] for p in parts), parts[0].shape[1], dtype=torch.uint8)
    start = 0
    for part in parts:
        out[start : start + part.shape[0]] = torch.from_numpy(np.ascontiguousarray(part).view(np.uint8))
        start += part.shape[0]
    return out


def install_kept(model: nn.Module, kept: dict, linear_of, tie_word_embeddings: bool,
                 dtype: torch.dtype = torch.float32) -> set[str]:
    """Put `linear_of(names)` -> (GGUFLinear, the GGUF tensors it used) where each placeholder of
    `kept` ({(owner, attribute): GGUF weight names}) stands; `embed_tokens` becomes a GGUFEmbedding
    and, with tied embeddings, the LM head the same blocks. Returns every tensor name used."""
    consumed: set[str] = set()
    for (owner, attr), names in kept.items():
        linear, used = linear_of(names)
        if attr == "embed_tokens":
            model.embed_tokens = GGUFEmbedding(linear, dtype)
            if tie_word_embeddings:
                model.lm_head = linear
        else:
            setattr(owner, attr, linear)
        consumed.update(used)
    return consumed
