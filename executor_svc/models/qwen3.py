"""Qwen3: Llama with an RMSNorm over each head of q and k before rotary; sliding layers by `layer_types`."""

from __future__ import annotations

from executor_svc.model import DecoderModel, ModelConfig, weight_target
from executor_svc.models import ModelFamily
from executor_svc.models.hf_config import base_fields, check_activation, rope_fields


def read_config(hf, architecture: str) -> ModelConfig:
    fields = base_fields(hf, architecture)
    return ModelConfig(
        **fields, **rope_fields(hf, fields["head_dim"]), hidden_act=check_activation(hf, "silu"), qk_norm=True
    )


FAMILY = ModelFamily(read_config, DecoderModel, weight_target)
