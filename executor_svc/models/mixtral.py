"""Mixtral: Mistral's attention (one sliding window for every layer, if any); every layer's MLP a
sparse MoE block (`block_sparse_moe`, experts w1/w3/w2), the top-k weights always renormalised."""

from __future__ import annotations

from executor_svc.model import DecoderModel, ModelConfig, weight_target
from executor_svc.models import ModelFamily
from executor_svc.models.hf_config import base_fields, check_activation, rope_fields


def read_config(hf, architecture: str) -> ModelConfig:
    fields = base_fields(hf, architecture, qkv_bias=False, o_bias=False)
    return ModelConfig(
        **fields,
        **rope_fields(hf, fields["head_dim"]),
        hidden_act=check_activation(hf, "silu"),
        num_experts=hf.num_local_experts,
        num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,
        norm_topk_prob=True,
        sparse_layers=(True,) * hf.num_hidden_layers,
    )


FAMILY = ModelFamily(read_config, DecoderModel, weight_target)
