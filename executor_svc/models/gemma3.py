"""Gemma 3 (text): Gemma 2 with q/k norms instead of the attention soft cap, and its own RoPE for the
sliding layers (`rope_parameters["sliding_attention"]`, the local base); five sliding layers to one
full by default (`layer_types`).

`Gemma3ForConditionalGeneration` (the 4B/12B/27B checkpoints: `text_config` + `vision_config`):
its language model is this decoder, from the config's `text_config`, the weights under
`language_model.model.*` / `model.language_model.*` (the layout depends on the transformers
version that saved it) read as the text model's; the SigLIP tower and the projector (average
pool to `mm_tokens_per_image` soft tokens) are transformers' own, loaded beside it
(`executor_svc.vision`). As in transformers, an image's soft tokens attend to each other both
ways (`ModelConfig.image_bidirectional`); text-only requests run exactly as the text model.
"""

from __future__ import annotations

from executor_svc.model import DecoderModel, ModelConfig
from executor_svc.model import weight_target as text_weight_target
from executor_svc.models import ModelFamily
from executor_svc.models.hf_config import base_fields, check_activation, rope, unsupported
from executor_svc.vision import text_weight_name

MULTIMODAL = "Gemma3ForConditionalGeneration"


def read_config(hf, architecture: str) -> ModelConfig:
    top = hf
    if architecture == MULTIMODAL:
        hf = top.get_text_config()
    if getattr(hf, "use_bidirectional_attention", False):
        raise unsupported("use_bidirectional_attention: only causal attention is supported")
    fields = base_fields(hf, architecture)
    if top is not hf:  # what the multimodal config sets itself: the head's tying, the end tokens
        fields["tie_word_embeddings"] = bool(getattr(top, "tie_word_embeddings", fields["tie_word_embeddings"]))
        eos = getattr(top, "eos_token_id", None)
        if eos is not None:
            fields["eos_token_ids"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    head_dim = fields["head_dim"]
    inv_freq, scaling, dim = rope(hf, head_dim, "full_attention")
    local_inv_freq, local_scaling, local_dim = rope(hf, head_dim, "sliding_attention")
    if dim != head_dim or local_dim != head_dim:
        raise unsupported("partial rotary is not supported for Gemma 3")
    return ModelConfig(
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
        multimodal=top if top is not hf else None,
        image_bidirectional=top is not hf,
    )


def weight_target(name: str, config: ModelConfig):
    """The text model's target (`layers.weight_target`) of a checkpoint tensor; a multimodal
    checkpoint's language-model names are read as the text model's, its vision weights skipped
    (they are the tower's: `executor_svc.vision.VisionEncoder.load`)."""
    name = text_weight_name(name)
    return None if name is None else text_weight_target(name, config)


FAMILY = ModelFamily(read_config, DecoderModel, weight_target)
