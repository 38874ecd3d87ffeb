"""Load a Hugging Face directory (config.json + *.safetensors) into the `DecoderModel`.

Only the config is read through transformers (`AutoConfig`, local directory, no hub);
weights are streamed tensor by tensor from safetensors straight into the model's
parameters, on the target device and dtype. No transformers model is instantiated.
A directory that stands for a GGUF file (`pagoda.model_files.gguf_source`), or the file
itself, is read by `executor_svc.models.gguf`: its blocks kept (`quantization="gguf"`) or dequantized as transformers does
(`"none"`). `"int8"` then requantizes every linear layer (`executor_svc.quant.int8_linear`).

Supported: the families of `executor_svc.models` (`SUPPORTED_ARCHITECTURES`), each reading
its config and placing its tensors; RoPE types whose inverse frequencies do not depend on
the sequence length (default, linear, llama3, yarn). Sliding windows (Mistral, Qwen2/3
`layer_types`, Gemma 2/3) are kept: `ModelConfig.layer_types`, one KV cache group per window.

Checkpoint names map onto the decoder's merged projections (`executor_svc.model.weight_target`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
import torch
from safetensors import safe_open

from executor_svc.model import DecoderModel, ModelConfig
from executor_svc.models import BY_MODEL_TYPE, SUPPORTED_ARCHITECTURES, family  # noqa: F401 (re-exported)
from pagoda.model_files import gguf_source

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "gguf", "int8")
# the families that int8 and tensor parallelism have been checked on (against transformers)
LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class UnsupportedModelError(ValueError):
    """The directory holds a model this loader cannot run faithfully."""


def load_config(model_dir: str | Path) -> ModelConfig:
    """The config of a Hugging Face directory or (read by transformers from its metadata) a .gguf file,
    read by its family (`executor_svc.models`); an architecture without one is refused. A MoE GGUF
    file's config (Qwen3-MoE, Mixtral) is read from its metadata by `models.gguf_config`, whatever
    the directory standing for it holds: transformers' reading of these is wrong."""
    from transformers import AutoConfig

    from executor_svc.models.gguf_config import moe_hf_config

    model_dir = Path(model_dir)
    gguf_file = model_dir if model_dir.suffix == ".gguf" else gguf_source(model_dir)
    hf = None if gguf_file is None else moe_hf_config(gguf_file)
    if hf is None and model_dir.suffix == ".gguf":
        hf = AutoConfig.from_pretrained(str(model_dir.parent), gguf_file=model_dir.name, local_files_only=True)
    elif hf is None:
        hf = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    architecture = (getattr(hf, "architectures", None) or [BY_MODEL_TYPE.get(hf.model_type, hf.model_type)])[0]
    return family(architecture).read_config(hf, architecture)


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    return files


def load_model(
    model_dir: str | Path, device: torch.device, dtype: torch.dtype, quantization: str = "none", tp=None
) -> DecoderModel:
    """Build the decoder on `device` in `dtype` (no random init) and fill it from the checkpoint.

    `quantization`: "none" (weights in `dtype`), "gguf" (a GGUF file's blocks kept as they are,
    CPU float32 or bfloat16 activations) or "int8" (every linear layer requantized to int8, CPU only).
    `tp` (a `TensorParallel` of size > 1): build the rank's shard and read only its slices
    (safetensors weights, quantization "none").
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}: expected one of {QUANTIZATIONS}")
    model_dir = Path(model_dir)
    gguf_file = model_dir if model_dir.suffix == ".gguf" else gguf_source(model_dir)
    if quantization == "gguf" and gguf_file is None:
        raise UnsupportedModelError(f"{model_dir}: quantization 'gguf' needs a .gguf model")
    dtypes = (torch.float32, torch.bfloat16) if quantization == "gguf" else (torch.float32,)
    if quantization != "none" and (device.type != "cpu" or dtype not in dtypes):
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise UnsupportedModelError(f"quantization {quantization!r} runs on the CPU in {names}, not {device} {dtype}")
    config = load_config(model_dir)
    if config.architecture not in LLAMA_FAMILY and (quantization == "int8" or (tp is not None and tp.size > 1)):
        raise UnsupportedModelError(f"{config.architecture}: int8 and tensor parallelism are for Llama-family models only")
    read = None
    if tp is not None and tp.size > 1:
        if gguf_file is not None or quantization != "none":
            raise UnsupportedModelError(
                f"tensor parallelism shards safetensors weights only (quantization 'none'), not "
                f"{'a GGUF model' if gguf_file is not None else 'quantization ' + repr(quantization)}"
            )
        from executor_svc.parallel.sharding import TensorShards

        shards = TensorShards(config, tp.rank, tp.size)  # refuses a model that does not split
        config, read = shards.local_config, shards.read
    if gguf_file is not None:
        from executor_svc.models.gguf import load_gguf

        model = load_gguf(gguf_file, config, device, dtype, keep_blocks=quantization == "gguf")
    else:
        with torch.device("meta"):
            model = family(config.architecture).build(config, dtype=dtype, tp=tp)
        model = model.to_empty(device=device)
        model.init_buffers()
        load_weights(model, model_dir, read)
        model.vision = load_vision(config, model_dir, device, dtype)
    if quantization == "int8":
        from executor_svc.quant.gguf_kernel import get_kernel
        from executor_svc.quant.int8_linear import quantize_linears

        kernel = get_kernel()
        if kernel is None:
            raise UnsupportedModelError("quantization 'int8' needs the C kernel (no compiler here, or the backend's gguf_kernel off)")
        quantize_linears(model, kernel)
    return model.eval()


def load_vision(config: ModelConfig, model_dir: Path, device: torch.device, dtype: torch.dtype):
    """A vision-language checkpoint's tower and projector (`executor_svc.vision.VisionEncoder`), or None."""
    from executor_svc.vision import VisionEncoder, vision_architectures

    if config.multimodal is None or config.architecture not in vision_architectures():
        return None
    encoder = VisionEncoder(config.multimodal, config.architecture, device, dtype)
    encoder.load(weight_files(model_dir))
    return encoder


def load_weights(model: torch.nn.Module, model_dir: str | Path, read=None) -> None:
    """Copy every safetensors tensor of the checkpoint into `model` (see `fill_parameters`).

    `read(name, slice)`, when given, returns the part of a tensor this model holds from a
    safetensors slice (`safe_open(...).get_slice(name)`), so a tensor-parallel rank never
    reads the whole tensor.
    """

    def load(f, name: str) -> torch.Tensor:
        return f.get_tensor(name) if read is None else read(name, f.get_slice(name))

    def tensors():
        for path in weight_files(model_dir):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    yield f"{path.name}: {name}", name, lambda f=f, name=name: load(f, name)

    fill_parameters(model, tensors(), str(model_dir))


def fill_parameters(model: torch.nn.Module, tensors, source: str) -> None:
    """Copy checkpoint tensors into `model`'s parameters; every parameter must be filled exactly once.

    `tensors` yields (where, checkpoint name in Hugging Face's naming, a function returning the tensor).
    """
    config: ModelConfig = model.config
    target_of = family(config.architecture).weight_target
    params = dict(model.named_parameters())  # a tied lm_head is embed_tokens, listed once
    filled = dict.fromkeys(params, 0)  # elements
    for where, name, read in tensors:
        target = target_of(name, config)
        if target is None:
            continue
        param_name, start = target
        if param_name not in params:
            raise UnsupportedModelError(f"{where}: tensor {name} has no place in the model")
        tensor = read()
        rows = params[param_name].data
        if isinstance(start, tuple):  # (expert, first row or None)
            rows, start = rows[start[0]], start[1]
        if start is not None:
            rows = rows.narrow(0, start, tensor.shape[0])
        if rows.shape != tensor.shape:
            raise UnsupportedModelError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(rows.shape)}")
        rows.copy_(tensor)
        filled[param_name] += tensor.numel()
    missing = [name for name, param in params.items() if filled[name] != param.numel()]
    if missing:
        raise UnsupportedModelError(f"checkpoint {source} does not fill {len(missing)} tensors, e.g. {missing[:3]}")


def weight_bytes(model: torch.nn.Module) -> int:
    """Resident bytes of the model's weights: parameters and buffers, each storage once (tied weights share one)."""
    storages: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta":
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())
