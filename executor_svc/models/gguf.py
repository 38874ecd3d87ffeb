"""A GGUF file of a non-Llama family (Qwen3, Phi-3, Gemma 2, Gemma 3) into a `FamilyDecoder`.

Llama-family files (llama, mistral, qwen2) keep going through `executor_svc.quant.gguf_loader`
(blocks kept, the CPU decode path). Here every tensor is dequantized (the `gguf` package's
`dequantize`, as transformers' own GGUF loading) and renamed to its Hugging Face name, then
placed by the safetensors loader's `fill_parameters`. What follows llama.cpp's converter, as
transformers undoes it:

- Gemma's norm weights are stored as 1 + w (llama.cpp adds the 1): 1 is subtracted;
- Gemma's `ffn_norm` is the norm before the MLP, `post_attention_norm` / `post_ffw_norm` the
  norms after attention and the MLP; elsewhere `ffn_norm` is Llama's post-attention norm;
- Phi-3's `attn_qkv` and `ffn_up` are the merged projections as its checkpoint stores them;
- no q/k row permutation (llama.cpp permutes "llama" files only).

Nothing is kept in blocks: a model of these families loads as quantization "none".
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

# GGUF architecture -> what its tensors are called (the name map of llama.cpp's converter)
# (not qwen3moe: transformers' GGUF config of it has no `moe_intermediate_size`, so no reference reads one)
ARCHITECTURES = ("qwen3", "phi3", "gemma2", "gemma3")
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA_LAYER = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_IGNORED = ("rope_freqs.weight",)


def hf_tensors(path: Path) -> Iterator[tuple[str, str, object]]:
    """(where, Hugging Face name, read) for every weight of the file (see `loader.fill_parameters`)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from executor_svc.loader import UnsupportedModelError

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{path.name}: GGUF architecture {arch!r} (expected one of {ARCHITECTURES})")
    gemma = arch.startswith("gemma")
    layer_names = {**_LAYER, **(_GEMMA_LAYER if gemma else {})}
    if arch == "phi3":
        layer_names["ffn_up"] = "mlp.gate_up_proj"

    def values(t) -> torch.Tensor:
        data = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a copy: the file is mapped read-only
        if gemma and t.name.endswith("norm.weight"):
            data = data - 1.0
        return torch.from_numpy(data)

    for t in reader.tensors:
        if t.name in _IGNORED:
            continue
        base, _, suffix = t.name.rpartition(".")
        parts = base.split(".")
        where = f"{path.name}: {t.name}"
        if base in _GLOBAL:
            yield where, f"{_GLOBAL[base]}.{suffix}", lambda t=t: values(t)
        elif parts[0] == "blk" and len(parts) == 3 and parts[2] in layer_names:
            yield where, f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}", lambda t=t: values(t)
        else:
            raise UnsupportedModelError(f"GGUF tensor {t.name} has no place in a {arch} model")


def load_family_gguf(path: Path, config, device: torch.device, dtype: torch.dtype):
    """The family's model on `device` in `dtype`, filled from the GGUF file (all dequantized)."""
    from executor_svc.loader import fill_parameters, weight_bytes
    from executor_svc.models import family

    with torch.device("meta"):
        model = family(config.architecture).build(config, dtype=dtype)
    model = model.to_empty(device=device)
    model.init_buffers()
    fill_parameters(model, hf_tensors(path), str(path))
    log.info("%s: %s, dequantized, %.1f MiB resident", path.name, config.architecture, weight_bytes(model) / 2**20)
    return model
