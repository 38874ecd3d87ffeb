"""Qwen3-MoE: Qwen3's attention; every `decoder_sparse_step`-th layer (but `mlp_only_layers`) a sparse
MoE block of `num_experts` experts, top `num_experts_per_tok`, renormalised if `norm_topk_prob`."""

from __future__ import annotations

from executor_svc.model import DecoderModel, ModelConfig, weight_target
from executor_svc.models import ModelFamily
from executor_svc.models.hf_config import base_fields, check_activation, rope_fields


def read_config(hf, architecture: str) -> ModelConfig:
    fields = base_fields(hf, architecture)
    step, dense = hf.decoder_sparse_step, set(getattr(hf, "mlp_only_layers", None) or ())
    sparse = tuple(
        i not in dense and hf.num_experts > 0 and (i + 1) % step == 0 for i in range(hf.num_hidden_layers)
    )
    return ModelConfig(
        **fields,
        **rope_fields(hf, fields["head_dim"]),
        hidden_act=check_activation(hf, "silu"),
        qk_norm=True,
        num_experts=hf.num_experts,
        num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        norm_topk_prob=bool(hf.norm_topk_prob),
        sparse_layers=sparse,
    )


FAMILY = ModelFamily(read_config, DecoderModel, weight_target)
