"""Gemma 2: embeddings scaled by sqrt(hidden), RMSNorm scale 1 + w, norms around attention and MLP,
GeGLU, queries scaled by `query_pre_attn_scalar` ** -0.5, attention scores and final logits
soft-capped, sliding and full layers alternating (`layer_types`)."""

from __future__ import annotations

from executor_svc.model import DecoderModel, ModelConfig, weight_target
from executor_svc.models import ModelFamily
from executor_svc.models.hf_config import base_fields, check_activation, rope_fields


def read_config(hf, architecture: str) -> ModelConfig:
    fields = base_fields(hf, architecture)
    return ModelConfig(
        **fields,
        **rope_fields(hf, fields["head_dim"]),
        hidden_act=check_activation(hf, "gelu_pytorch_tanh", field="hidden_activation"),
        gemma_norm=True,
        sandwich_norms=True,
        embed_scale=hf.hidden_size**0.5,
        attn_scale=hf.query_pre_attn_scalar**-0.5,
        attn_logit_softcap=hf.attn_logit_softcapping,
        final_logit_softcap=hf.final_logit_softcapping,
    )


FAMILY = ModelFamily(read_config, DecoderModel, weight_target)
