"""Load a GGUF file straight into a `DecoderModel`: blocks kept (`keep_blocks`) or dequantized.

The file is read with the `gguf` package's reader (memory-mapped). Names map onto the
Hugging Face ones (`blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`) and
go through the safetensors loader's `fill_parameters`, so merged projections, tied heads
and the fill-exactly-once check are the same code. Two things follow transformers' own
GGUF loading, which the tests compare against:

- llama.cpp's converter permutes the rows of q and k of "llama" files (its rotary layout);
  transformers undoes it (`LlamaTensorProcessor`), and so do we — on whole rows, which for
  packed blocks are byte rows: blocks run along the input dimension;
- dequantization is the `gguf` package's (`gguf.quants.dequantize`), or for kept blocks the
  kernel's, which tests check against it for every supported type.

With `keep_blocks`, every projection whose parts all have a type the kernel supports
becomes a `GGUFLinear` (q, k and v become one module with one segment per run of equal
types); the token embedding becomes a `GGUFEmbedding` and, when tied, the LM head is the
same blocks. Anything else (F32/F16 tensors, unsupported types) is dequantized into parameters
of the model's dtype. No float32 copy of a kept weight is ever made: the projections are swapped out
while the model is still on the meta device.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from executor_svc.loader import UnsupportedModelError, fill_parameters, weight_bytes
from executor_svc.model import ModelConfig
from executor_svc.model import DecoderModel
from executor_svc.quant.gguf_kernel import get_kernel
from executor_svc.quant.gguf_linear import GGUFLinear, install_kept, packed_rows

log = logging.getLogger(__name__)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_IGNORED = ("rope_freqs.weight",)  # llama3 files: the RoPE factors come from the config
# Each merged projection of a layer and the GGUF tensors whose rows it stacks.
_PROJECTIONS = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}
_FLOAT_TYPES = (0, 1)  # F32, F16


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face checkpoint name of a GGUF tensor (None: not a model weight)."""
    if gguf_name in _IGNORED:
        return None
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name} has no place in the model")


def unpermute_qk(name: str, rows: np.ndarray, config: ModelConfig) -> np.ndarray:
    """The rows of a "llama" file's tensor `name` in transformers' order: llama.cpp's converter
    permutes q and k (and their biases) per head; any other tensor is returned as it is."""
    if ".attn_q." not in name and ".attn_k." not in name:
        return rows
    heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
    half = rows.shape[0] // heads // 2  # as transformers' LlamaTensorProcessor._reverse_permute_weights
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


class _File:
    """The tensors of a GGUF file by name, with transformers' q/k row order."""

    def __init__(self, path: Path, config: ModelConfig) -> None:
        from gguf import GGUFReader

        self.reader = GGUFReader(str(path))
        field = self.reader.fields["general.architecture"]
        self.architecture = bytes(field.parts[field.data[0]]).decode()
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.config = config

    def rows(self, name: str) -> np.ndarray:
        """The tensor's rows as stored ([out, in] floats, or [out, row_bytes] blocks), q/k unpermuted."""
        data = self.tensors[name].data
        data = data.reshape(data.shape[0], -1) if data.ndim > 1 else data
        if self.architecture == "llama":
            data = unpermute_qk(name, data, self.config)
        return data

    def dequantized(self, name: str) -> torch.Tensor:
        from gguf.quants import dequantize

        t = self.tensors[name]
        values = dequantize(self.rows(name), t.tensor_type)
        return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the file is mapped read-only

    def ggml_type(self, name: str) -> int:
        return int(self.tensors[name].tensor_type)


def load_gguf_model(
    path: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype, keep_blocks: bool
) -> DecoderModel:
    f = _File(path, config)
    kernel = get_kernel() if keep_blocks else None
    if keep_blocks and kernel is None:
        log.warning("%s: no GGUF kernel here: weights dequantized to float32", path)
    with torch.device("meta"):
        model = DecoderModel(config, dtype=dtype)
    kept: dict[tuple[nn.Module, str], list[str]] = {}
    if kernel is not None:
        for i, layer in enumerate(model.layers):
            for attr, parts in _PROJECTIONS.items():
                names = [f"blk.{i}.{p}.weight" for p in parts]
                if all(_can_keep(f, n, kernel) for n in names):
                    kept[(layer, attr)] = names
                    setattr(layer, attr, nn.Identity())  # placeholder: no float32 weight is allocated
        if _can_keep(f, "token_embd.weight", kernel):
            kept[(model, "embed_tokens")] = ["token_embd.weight"]
            model.embed_tokens = nn.Identity()
        if not config.tie_word_embeddings and _can_keep(f, "output.weight", kernel):
            kept[(model, "lm_head")] = ["output.weight"]
            model.lm_head = nn.Identity()
    model = model.to_empty(device=device)
    model.init_buffers()
    def linear_of(names: list[str]) -> tuple[GGUFLinear, list[str]]:
        biases = [n.removesuffix(".weight") + ".bias" for n in names]
        has_bias = all(b in f.tensors for b in biases)
        bias = torch.cat([f.dequantized(b) for b in biases]) if has_bias else None
        in_features = int(f.tensors[names[0]].shape[0])  # GGUF shapes are [in, out]
        return GGUFLinear(kernel, in_features, _segments(f, names), bias), names + (biases if has_bias else [])

    consumed = install_kept(model, kept, linear_of, config.tie_word_embeddings, dtype)

    def tensors() -> Iterator[tuple[str, str, object]]:
        for name in f.tensors:
            if name in consumed:
                continue
            target = hf_name(name)
            if target is not None:
                yield f"{path.name}: {name}", target, lambda name=name: f.dequantized(name)

    fill_parameters(model, tensors(), str(path))
    log.info(
        "%s: %s, %d of %d weights kept in GGUF blocks, %.1f MiB resident",
        path.name,
        f.architecture,
        len(consumed),
        len(f.tensors),
        weight_bytes(model) / 2**20,
    )
    return model


def _can_keep(f: _File, name: str, kernel) -> bool:
    t = f.tensors.get(name)
    return t is not None and f.ggml_type(name) not in _FLOAT_TYPES and kernel.supports(f.ggml_type(name), int(t.shape[0]))


def _segments(f: _File, names: list[str]) -> list[tuple[int, torch.Tensor]]:
    """One (type, rows) segment per run of parts with equal types, each copied once into its own tensor."""
    runs: list[tuple[int, list[np.ndarray]]] = []
    for name in names:
        ggml_type = f.ggml_type(name)
        if runs and runs[-1][0] == ggml_type:
            runs[-1][1].append(f.rows(name))
        else:
            runs.append((ggml_type, [f.rows(name)]))
    return [(t, packed_rows(parts)) for t, parts in runs]
