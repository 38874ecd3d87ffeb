"""The model families the executor runs, keyed by the Hugging Face architecture name.

Each family is one module with a `FAMILY`: how its config is read (`read_config`, from
transformers' config object), the model class built from it (`build`) and where each
checkpoint tensor goes (`weight_target`). Every family builds `executor_svc.model`'s one
`DecoderModel` (the fused-op and CPU decode paths) with its own switches of `ModelConfig`.
Adding a family is a module here and a line below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# architecture -> module of executor_svc.models
_MODULES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its language model, and its vision tower (executor_svc.vision)
    "LlavaForConditionalGeneration": "llava",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}
SUPPORTED_ARCHITECTURES = tuple(_MODULES)
# the architecture of a config without `architectures` (a GGUF file's, read by transformers or
# from a MoE file's metadata by `gguf_config`)
BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


@dataclass(frozen=True)
class ModelFamily:
    read_config: Callable[[Any, str], Any]  # (transformers config, architecture) -> ModelConfig
    build: Callable[..., Any]  # (config, dtype=, tp=) -> the model, on the current device
    weight_target: Callable[[str, Any], tuple[str, Any] | None]  # (checkpoint name, config) -> (param, where)


def family(architecture: str) -> ModelFamily:
    """The family of `architecture`; an unsupported one raises `UnsupportedModelError` naming it."""
    module = _MODULES.get(architecture)
    if module is None:
        from executor_svc.loader import UnsupportedModelError

        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported (expected one of {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return importlib.import_module(f"executor_svc.models.{module}").FAMILY
