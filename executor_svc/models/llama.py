"""Llama, Mistral (sliding window on every layer) and Qwen2 (q/k/v bias, windows from a layer on):
the decoder's defaults (`executor_svc.model.DecoderModel`)."""

from __future__ import annotations

from executor_svc.model import DecoderModel, ModelConfig, weight_target
from executor_svc.models import ModelFamily
from executor_svc.models.hf_config import base_fields, check_activation, rope, unsupported


def read_config(hf, architecture: str) -> ModelConfig:
    check_activation(hf, "silu")
    fields = base_fields(hf, architecture)
    if architecture == "Qwen2ForCausalLM":
        fields.update(qkv_bias=True, o_bias=False)
    inv_freq, scaling, dim = rope(hf, fields["head_dim"])
    if dim != fields["head_dim"]:
        raise unsupported("partial_rotary_factor != 1 is not supported")
    return ModelConfig(**fields, inv_freq=inv_freq, rope_attention_scaling=scaling)


FAMILY = ModelFamily(read_config, DecoderModel, weight_target)
