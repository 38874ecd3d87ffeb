"""Phi-3: Llama with q/k/v and gate/up stored merged (`qkv_proj`, `gate_up_proj`), partial rotary
(`partial_rotary_factor`), an optional sliding window on every layer."""

from __future__ import annotations

from executor_svc.model import DecoderModel, ModelConfig, weight_target
from executor_svc.models import ModelFamily
from executor_svc.models.hf_config import base_fields, check_activation, rope_fields


def read_config(hf, architecture: str) -> ModelConfig:
    fields = base_fields(hf, architecture, qkv_bias=False, o_bias=False)
    fields["mlp_bias"] = False
    return ModelConfig(**fields, **rope_fields(hf, fields["head_dim"]), hidden_act=check_activation(hf, "silu"))


FAMILY = ModelFamily(read_config, DecoderModel, weight_target)
