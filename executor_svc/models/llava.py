"""LLaVA (`LlavaForConditionalGeneration`): a text decoder of a supported family (Llama, Mistral,
Qwen2, ... as its `text_config` says) and a vision tower (CLIP or SigLIP) with an MLP projector.

The decoder is the text family's, read from `text_config`; the tower and projector are
transformers' own (`executor_svc.vision.VisionEncoder`, built by the loader from
`ModelConfig.multimodal`), their features selected as transformers does
(`vision_feature_layer`, `vision_feature_select_strategy`). Weights: the language model's
under `model.language_model.*` (or `language_model.model.*`, older layouts), the vision ones
under `model.vision_tower.*` / `model.multi_modal_projector.*` (or without `model.`).
"""

from __future__ import annotations

from dataclasses import replace

from executor_svc.model import DecoderModel, ModelConfig
from executor_svc.models import BY_MODEL_TYPE, ModelFamily, family
from executor_svc.models.hf_config import unsupported
from executor_svc.vision import text_weight_name, top_level_overrides

# a multimodal checkpoint's language-model prefixes -> the text model's


def text_architecture(hf) -> str:
    text = hf.get_text_config()
    architecture = (getattr(text, "architectures", None) or [BY_MODEL_TYPE.get(text.model_type, text.model_type)])[0]
    if architecture.endswith("ForConditionalGeneration"):
        raise unsupported(f"LLaVA with the text model {architecture!r}")
    return architecture


def read_config(hf, architecture: str) -> ModelConfig:
    text = hf.get_text_config()
    text_arch = text_architecture(hf)
    config = family(text_arch).read_config(text, text_arch)
    return replace(config, architecture=architecture, multimodal=hf, **top_level_overrides(hf))


def weight_target(name: str, config: ModelConfig):
    """The text family's target of a language-model tensor; vision tensors are the tower's (skipped here)."""
    name = text_weight_name(name)
    return None if name is None else family(text_architecture(config.multimodal)).weight_target(name, config)


FAMILY = ModelFamily(read_config, DecoderModel, weight_target)
