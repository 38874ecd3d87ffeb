"""The model's elementwise ops as Triton kernels (kernels/), used with the triton backend."""

from __future__ import annotations

import torch

from executor_svc.model import ModelOps


def triton_model_ops() -> ModelOps:
    """RMSNorm (+ residual add), rotary and SiLU-and-multiply from kernels/; same contracts as the torch ops."""
    from kernels.activation import silu_and_mul
    from kernels.rms_norm import fused_add_rms_norm, rms_norm
    from kernels.rotary import rotary_embedding

    def apply_rotary(q, k, cos, sin):
        # cos, sin are the step's rows [T, D/2] already: row i rotates token i.
        cos_sin = torch.cat((cos, sin), dim=-1).contiguous()
        positions = torch.arange(q.shape[0], device=q.device)
        q, k = q.contiguous(), k.contiguous()
        rotary_embedding(positions, q, k, cos_sin)
        return q, k

    return ModelOps(
        rms_norm=rms_norm,
        add_rms_norm=fused_add_rms_norm,
        apply_rotary=apply_rotary,
        silu_and_mul=silu_and_mul,
    )
