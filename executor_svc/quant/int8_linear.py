"""`--quantization int8`: every linear layer's weight in int8 with one scale per output channel.

Quantized at load (symmetric, scale = max |w| / 127 per row, round to nearest) into the
GGUF kernel's `I8_ROW` layout (a row is its float32 scale, then the int8 values) and run as
a `GGUFLinear`: weights dequantized on the fly, activations and accumulation in float32.

Weight-only on purpose. FBGEMM's dynamic int8 linear (torch.ops.quantized.linear_dynamic)
is faster per call, but it also quantizes the activations, per tensor: measured on the
default model, greedy output left transformers' at the first generated token for two of
three chat prompts ("The capital of France is" -> "120 million euros."), where int8 weights
alone keep it (tests/executor/test_int8.py states the bound). The token embedding stays
float32 (a lookup reads one row a token); a tied LM head gets its own int8 copy.
"""

from __future__ import annotations

import torch
from torch import nn

from executor_svc.model import DecoderModel
from executor_svc.quant.gguf_kernel import I8_ROW, GGUFKernel
from executor_svc.quant.gguf_linear import GGUFLinear


def int8_rows(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> [N, 4 + K] uint8 rows: float32 scale (max |w| / 127), then round(w / scale) as int8."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(weight / scales).clamp(-127, 127).to(torch.int8)
    return torch.cat([scales.view(torch.uint8), q.view(torch.uint8)], dim=1).contiguous()


def int8_linear(kernel: GGUFKernel, weight: torch.Tensor, bias: torch.Tensor | None) -> GGUFLinear:
    return GGUFLinear(kernel, weight.shape[1], [(I8_ROW, int8_rows(weight))], None if bias is None else bias.detach().float())


def quantize_linears(model: DecoderModel, kernel: GGUFKernel) -> None:
    """Replace every float projection and the LM head (tied: a copy of the embedding) by int8 ones."""
    for owner, name in model.projections():
        linear = getattr(owner, name)
        if type(linear) is nn.Linear and kernel.supports(I8_ROW, linear.in_features):
            setattr(owner, name, int8_linear(kernel, linear.weight, linear.bias))
    head = model.embed_tokens.weight if model.lm_head is None else getattr(model.lm_head, "weight", None)
    if head is not None and kernel.supports(I8_ROW, head.shape[1]):
        model.lm_head = int8_linear(kernel, head, None)
