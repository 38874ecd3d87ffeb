"""Load a Hugging Face directory (config.json + *.safetensors) into a `DecoderModel`.

Only the config is read through transformers (`AutoConfig`, local directory, no hub);
weights are streamed tensor by tensor from safetensors straight into the model's
parameters, on the target device and dtype. No transformers model is instantiated.
A directory that stands for a GGUF file (`pagoda.model_files.gguf_source`), or the file
itself, is read by `executor_svc.quant.gguf_loader`: its blocks kept (`quantization="gguf"`)
or dequantized as transformers does (`"none"`). `"int8"` then requantizes every linear layer
(`executor_svc.quant.int8_linear`).

Supported: Llama-family decoders (`LlamaForCausalLM`, `MistralForCausalLM`,
`Qwen2ForCausalLM`): q/k/v bias (Qwen2), tied or untied embeddings, RoPE types whose
inverse frequencies do not depend on the sequence length (default, linear, llama3,
yarn). Sliding-window attention (Mistral, Qwen2 `use_sliding_window`) is ignored: every
layer attends to the full context, which matches a windowed model only while sequences
are shorter than the window.

Checkpoint names map onto the merged projections::

    model.layers.N.self_attn.{q,k,v}_proj.{weight,bias}  ->  layers.N.qkv_proj  rows [q | k | v]
    model.layers.N.mlp.{gate,up}_proj.weight             ->  layers.N.gate_up_proj rows [gate | up]
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from executor_svc.model import ModelConfig
from pagoda.model_files import gguf_source

if TYPE_CHECKING:
    from executor_svc.model import DecoderModel

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
QUANTIZATIONS = ("none", "gguf", "int8")


class UnsupportedModelError(ValueError):
    """The directory holds a model this loader cannot run faithfully."""


def load_config(model_dir: str | Path) -> ModelConfig:
    """The config of a Hugging Face directory or (read by transformers from its metadata) a .gguf file."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if model_dir.suffix == ".gguf":
        hf = AutoConfig.from_pretrained(str(model_dir.parent), gguf_file=model_dir.name, local_files_only=True)
    else:
        hf = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    by_model_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    architecture = (getattr(hf, "architectures", None) or [by_model_type.get(hf.model_type, hf.model_type)])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported (expected one of {SUPPORTED_ARCHITECTURES})"
        )
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf.hidden_act!r}: only silu is supported")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    if hf.num_attention_heads % num_kv_heads:
        raise UnsupportedModelError(
            f"num_attention_heads {hf.num_attention_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
        )
    inv_freq, attention_scaling = _rope(hf, head_dim)
    eos = hf.eos_token_id
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    sliding_window = getattr(hf, "sliding_window", None)
    if sliding_window is not None and sliding_window < hf.max_position_embeddings:
        logger.warning(
            "%s: sliding_window %d is ignored (full attention): outputs differ past %d tokens",
            model_dir,
            sliding_window,
            sliding_window,
        )
    return ModelConfig(
        architecture=architecture,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=True if is_qwen2 else bool(getattr(hf, "attention_bias", False)),
        o_bias=False if is_qwen2 else bool(getattr(hf, "attention_bias", False)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        inv_freq=tuple(inv_freq.tolist()),
        rope_attention_scaling=float(attention_scaling),
        sliding_window=sliding_window,
        eos_token_ids=eos_ids,
    )


def _rope(hf, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies through transformers' own RoPE initialisers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported (expected one of {STATIC_ROPE_TYPES})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv_freq.float(), attention_scaling


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
    from executor_svc.model import DecoderModel

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
        from executor_svc.quant.gguf_loader import load_gguf_model

        model = load_gguf_model(gguf_file, config, device, dtype, keep_blocks=quantization == "gguf")
    else:
        with torch.device("meta"):
            model = DecoderModel(config, dtype=dtype, tp=tp)
        model = model.to_empty(device=device)
        model.init_buffers()
        load_weights(model, model_dir, read)
    if quantization == "int8":
        from executor_svc.quant.gguf_kernel import get_kernel
        from executor_svc.quant.int8_linear import quantize_linears

        kernel = get_kernel()
        if kernel is None:
            raise UnsupportedModelError("quantization 'int8' needs the C kernel (no compiler here, or PAGODA_GGUF_KERNEL=0)")
        quantize_linears(model, kernel)
    return model.eval()


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
    params = dict(model.named_parameters())  # a tied lm_head is embed_tokens, listed once
    rows_filled = dict.fromkeys(params, 0)
    for where, name, read in tensors:
        target = _target(name, config)
        if target is None:
            continue
        param_name, row_start = target
        if param_name not in params:
            raise UnsupportedModelError(f"{where}: tensor {name} has no place in the model")
        tensor = read()
        param = params[param_name].data
        rows = param if row_start is None else param.narrow(0, row_start, tensor.shape[0])
        if rows.shape != tensor.shape:
            raise UnsupportedModelError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(rows.shape)}")
        rows.copy_(tensor)
        rows_filled[param_name] += tensor.shape[0]
    missing = [name for name, param in params.items() if rows_filled[name] != param.shape[0]]
    if missing:
        raise UnsupportedModelError(f"checkpoint {source} does not fill {len(missing)} tensors, e.g. {missing[:3]}")


_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _target(name: str, config: ModelConfig) -> tuple[str, int | None] | None:
    """Map a checkpoint tensor name to (parameter name, first row or None for the whole tensor)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name.startswith("lm_head."):
        return None if config.tie_word_embeddings else (name, None)
    parts = name.removeprefix("model.").split(".")
    if parts[0] != "layers":
        return ".".join(parts), None  # embed_tokens.weight, norm.weight
    layer, rest = parts[1], parts[2:]  # e.g. ["self_attn", "q_proj", "weight"] or ["input_layernorm", "weight"]
    if len(rest) == 3 and rest[1] in _STACKED:
        merged, index = _STACKED[rest[1]]
        if merged == "qkv_proj":
            offsets = (0, config.q_size, config.q_size + config.kv_size)
        else:
            offsets = (0, config.intermediate_size)
        return f"layers.{layer}.{merged}.{rest[2]}", offsets[index]
    return f"layers.{layer}.{'.'.join(rest[-2:])}", None


def weight_bytes(model: torch.nn.Module) -> int:
    """Resident bytes of the model's weights: parameters and buffers, each storage once (tied weights share one)."""
    storages: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta":
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())
