"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): Qwen2's decoder (q/k/v bias) with multimodal
rotary positions, and transformers' own windowed vision transformer with its patch merger.

Each token's rotary position is three numbers (time, height, width): text tokens have all three
equal, an image's tokens their place in its grid (transformers' `get_rope_index`, run by the
runner on each prompt with images, `executor_svc.vision.VisionEncoder.rope_positions`); the
rotary frequencies are cut into `mrope_section` parts, each turned by one of the three.
Weights: the language model's under `model.language_model.*` (or `model.*`, older layouts), the
vision transformer's under `model.visual.*` (or `visual.*`).
"""

from __future__ import annotations

from executor_svc.model import DecoderModel, ModelConfig, weight_target as text_weight_target
from executor_svc.models import ModelFamily
from executor_svc.models.hf_config import base_fields, check_activation, rope, unsupported
from executor_svc.vision import text_weight_name, top_level_overrides



def read_config(hf, architecture: str) -> ModelConfig:
    text = hf.get_text_config()
    check_activation(text, "silu")
    fields = base_fields(text, architecture, qkv_bias=True, o_bias=False)
    if any(t == "sliding_attention" for t in fields["layer_types"]):
        raise unsupported("Qwen2.5-VL with sliding-window layers")
    fields.update(top_level_overrides(hf))
    inv_freq, scaling, dim = rope(text, fields["head_dim"])
    section = tuple(text.rope_parameters.get("mrope_section") or ())
    if dim != fields["head_dim"] or sum(section) != dim // 2 or len(section) != 3:
        raise unsupported(f"mrope_section {list(section)}: expected three parts of head_dim / 2 = {dim // 2}")
    return ModelConfig(**fields, inv_freq=inv_freq, rope_attention_scaling=scaling, mrope_section=section, multimodal=hf)


def weight_target(name: str, config: ModelConfig):
    name = text_weight_name(name)
    return None if name is None else text_weight_target(name, config)


FAMILY = ModelFamily(read_config, DecoderModel, weight_target)
