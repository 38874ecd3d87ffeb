"""Gemma 3 (text): Gemma 2 with q/k norms instead of the attention soft cap, and its own RoPE for the
sliding layers (`rope_parameters["sliding_attention"]`, the local base); five sliding layers to one
full by default (`layer_types`)."""

from __future__ import annotations

from executor_svc.models import ModelFamily
from executor_svc.models.hf_config import base_fields, check_activation, rope, unsupported
from executor_svc.models.layers import FamilyConfig, FamilyDecoder, weight_target


def read_config(hf, architecture: str) -> FamilyConfig:
    if getattr(hf, "use_bidirectional_attention", False):
        raise unsupported("use_bidirectional_attention: only causal attention is supported")
    fields = base_fields(hf, architecture)
    head_dim = fields["head_dim"]
    inv_freq, scaling, dim = rope(hf, head_dim, "full_attention")
    local_inv_freq, local_scaling, local_dim = rope(hf, head_dim, "sliding_attention")
    if dim != head_dim or local_dim != head_dim:
        raise unsupported("partial rotary is not supported for Gemma 3")
    return FamilyConfig(
        **fields,
        inv_freq=inv_freq,
        rope_attention_scaling=scaling,
        local_inv_freq=local_inv_freq,
        local_rope_attention_scaling=local_scaling,
        hidden_act=check_activation(hf, "gelu_pytorch_tanh", field="hidden_activation"),
        gemma_norm=True,
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=hf.hidden_size**0.5,
        attn_scale=hf.query_pre_attn_scalar**-0.5,
        final_logit_softcap=hf.final_logit_softcapping,
    )


FAMILY = ModelFamily(read_config, FamilyDecoder, weight_target)
