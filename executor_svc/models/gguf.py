"""A GGUF file into the `DecoderModel`: architectures llama (Llama, Mistral, and Mixtral with its
experts, as llama.cpp writes them), qwen2, qwen3, qwen3moe, phi3, gemma2, gemma3.

The file is read with the `gguf` package's reader (memory-mapped); the MoE files' config is read
from their metadata (`models.gguf_config`), the others' by transformers.
With `keep_blocks` every projection whose parts all have a
type the kernel supports becomes a `GGUFLinear` (q/k/v one module, a segment per run of equal
types; Phi-3's `attn_qkv` and gate/up `ffn_up` as stored), the token embedding a
`GGUFEmbedding` (rows dequantized as looked up) and, when tied, the LM head is the same blocks.
No float copy of a kept weight is ever made: the projections are swapped out while the model is
still on the meta device. Everything else -- norms, F32/F16 tensors, unsupported types, or all of it without
`keep_blocks` -- is dequantized (the `gguf` package's `dequantize`, as transformers' own GGUF
loading) into float parameters by its Hugging Face name, placed by the safetensors loader's
`fill_parameters`. What follows llama.cpp's converter, as transformers undoes it:

- Gemma's norm weights are stored as 1 + w (llama.cpp adds the 1): 1 is subtracted;
- Gemma's `ffn_norm` is the norm before the MLP, `post_attention_norm` / `post_ffw_norm` the
  norms after attention and the MLP; elsewhere `ffn_norm` is Llama's post-attention norm;
- Phi-3's `attn_qkv` and `ffn_up` are the merged projections as its checkpoint stores them;
- q/k rows are permuted in "llama" files only (`unpermute_qk`, as transformers'
  `LlamaTensorProcessor`): undone on whole rows, which for packed blocks are byte rows (blocks
  run along the input dimension); the other architectures' rows are kept as stored;
- experts are 3-D tensors `blk.N.ffn_{gate,up,down}_exps` [experts, out, in] and the router
  `ffn_gate_inp`: each expert's slice goes to `SparseMoE.experts_gate_up` / `experts_down`,
  dequantized (each tensor once); only the attention projections keep their blocks.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from executor_svc.quant.gguf_linear import GGUFLinear, install_kept, packed_rows

log = logging.getLogger(__name__)

# the GGUF architectures read here; what their tensors are called (the name map of llama.cpp's converter)
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3")
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
    "ffn_gate_inp": "mlp.gate",
}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}  # mlp.experts.E.*
_GEMMA_LAYER = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_IGNORED = ("rope_freqs.weight",)


_FLOAT_TYPES = (0, 1)  # F32, F16: read as float parameters


def projections(arch: str) -> dict[tuple[str, str], tuple[str, ...]]:
    """(a layer's submodule, its projection) -> the GGUF tensors of the layer whose rows it stacks."""
    phi3 = arch == "phi3"
    return {
        ("self_attn", "qkv_proj"): ("attn_qkv",) if phi3 else ("attn_q", "attn_k", "attn_v"),
        ("self_attn", "o_proj"): ("attn_output",),
        ("mlp", "gate_up_proj"): ("ffn_up",) if phi3 else ("ffn_gate", "ffn_up"),
        ("mlp", "down_proj"): ("ffn_down",),
    }


def unpermute_qk(name: str, rows: np.ndarray, config) -> np.ndarray:
    """The rows of a "llama" file's tensor `name` in transformers' order: llama.cpp's converter
    permutes q and k (and their biases) per head; any other tensor is returned as it is."""
    if ".attn_q." not in name and ".attn_k." not in name:
        return rows
    heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
    half = rows.shape[0] // heads // 2  # as transformers' LlamaTensorProcessor._reverse_permute_weights
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def read_gguf(path: Path):
    """(the file's reader, its architecture); an architecture not of `ARCHITECTURES` is refused."""
    from gguf import GGUFReader

    from executor_svc.loader import UnsupportedModelError

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{path.name}: GGUF architecture {arch!r} (expected one of {ARCHITECTURES})")
    return reader, arch


def hf_tensors(path: Path, reader, arch: str, config, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, str, object]]:
    """(where, Hugging Face name, read) for every weight of the file not in `skip` (see `loader.fill_parameters`);
    an expert tensor yields one name per expert."""
    from executor_svc.loader import UnsupportedModelError

    gemma = arch.startswith("gemma")
    layer_names = {**_LAYER, **(_GEMMA_LAYER if gemma else {})}
    if arch == "phi3":
        layer_names["ffn_up"] = "mlp.gate_up_proj"

    def values(t) -> torch.Tensor:
        data = _floats(t, arch, config)
        return data - 1.0 if gemma and t.name.endswith("norm.weight") else data

    for t in reader.tensors:
        if t.name in _IGNORED or t.name in skip:
            continue
        base, _, suffix = t.name.rpartition(".")
        parts = base.split(".")
        where = f"{path.name}: {t.name}"
        if base in _GLOBAL:
            yield where, f"{_GLOBAL[base]}.{suffix}", lambda t=t: values(t)
        elif parts[0] == "blk" and len(parts) == 3 and parts[2] in layer_names:
            yield where, f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}", lambda t=t: values(t)
        elif parts[0] == "blk" and len(parts) == 3 and parts[2] in _EXPERTS and t.data.ndim == 3:
            expert = _per_expert(lambda t=t: values(t))
            for e in range(t.data.shape[0]):
                yield where, f"model.layers.{parts[1]}.mlp.experts.{e}.{_EXPERTS[parts[2]]}.{suffix}", lambda e=e: expert(e)
        else:
            raise UnsupportedModelError(f"GGUF tensor {t.name} has no place in a {arch} model")


def load_gguf(path: Path, config, device: torch.device, dtype: torch.dtype, keep_blocks: bool = False,
              skip: frozenset[str] = frozenset()):
    """The decoder on `device` in `dtype`, filled from the GGUF file: with `keep_blocks` (CPU,
    float32 or bfloat16) its projections, embedding and LM head in their blocks where the kernel takes them, the
    rest (all of it without) dequantized. The file's tensors named in `skip` are not read."""
    from executor_svc.loader import fill_parameters, weight_bytes
    from executor_svc.models import family
    from executor_svc.quant.gguf_kernel import get_kernel

    reader, arch = read_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    kernel = get_kernel() if keep_blocks else None
    if keep_blocks and kernel is None:
        log.warning("%s: no GGUF kernel here: weights dequantized to float32", path)

    def can_keep(name: str) -> bool:
        t = tensors.get(name)
        ggml_type = None if t is None else int(t.tensor_type)
        return ggml_type is not None and ggml_type not in _FLOAT_TYPES and kernel.supports(ggml_type, int(t.shape[0]))

    with torch.device("meta"):
        model = family(config.architecture).build(config, dtype=dtype)
    kept: dict[tuple[nn.Module, str], list[str]] = {}  # (owner, attribute) -> its GGUF tensors
    if kernel is not None:
        for i, layer in enumerate(model.layers):
            for (sub, attr), parts in projections(arch).items():
                owner = getattr(layer, sub)
                names = [f"blk.{i}.{p}.weight" for p in parts]
                if isinstance(getattr(owner, attr, None), nn.Linear) and all(can_keep(n) for n in names):
                    kept[(owner, attr)] = names
                    setattr(owner, attr, nn.Identity())  # placeholder: no float weight is allocated
        if can_keep("token_embd.weight"):
            kept[(model, "embed_tokens")] = ["token_embd.weight"]
            model.embed_tokens = nn.Identity()
        if not config.tie_word_embeddings and can_keep("output.weight"):
            kept[(model, "lm_head")] = ["output.weight"]
            model.lm_head = nn.Identity()
    model = model.to_empty(device=device)
    model.init_buffers()
    def linear_of(names: list[str]) -> tuple[GGUFLinear, list[str]]:
        biases = [n.removesuffix(".weight") + ".bias" for n in names]
        has_bias = all(b in tensors for b in biases)
        bias = torch.cat([_floats(tensors[b], arch, config) for b in biases]) if has_bias else None
        in_features = int(tensors[names[0]].shape[0])
        parts = [tensors[n] for n in names]
        return GGUFLinear(kernel, in_features, segments(parts, arch, config), bias), names + (biases if has_bias else [])

    # the decoder reads lm_head when it is set: a tied head is the embedding's blocks
    consumed = install_kept(model, kept, linear_of, config.tie_word_embeddings, dtype)
    fill_parameters(model, hf_tensors(path, reader, arch, config, frozenset(consumed) | skip), str(path))
    log.info(
        "%s: %s, %d of %d weights kept in GGUF blocks, %.1f MiB resident",
        path.name, config.architecture, len(consumed), len(tensors), weight_bytes(model) / 2**20,
    )
    return model


def _rows(t, arch: str, config) -> np.ndarray:
    """The tensor's data as stored ([out, in] floats or [out, row_bytes] blocks; experts with a leading
    expert dimension), a "llama" file's q/k rows unpermuted."""
    return unpermute_qk(t.name, t.data, config) if arch == "llama" else t.data


def _floats(t, arch: str, config) -> torch.Tensor:
    """The tensor dequantized into float32, a copy (the file is mapped read-only)."""
    from gguf.quants import dequantize

    return torch.from_numpy(np.array(dequantize(_rows(t, arch, config), t.tensor_type), dtype=np.float32))


def _per_expert(read):
    """expert(e) -> the e-th slice of `read()`, which runs once, at the first call."""
    whole: list[torch.Tensor] = []

    def expert(e: int) -> torch.Tensor:
        if not whole:
            whole.append(read())
        return whole[0][e]

    return expert


def segments(parts: list, arch: str, config) -> list[tuple[int, torch.Tensor]]:
    """One (type, rows) segment per run of GGUF tensors of equal types, each copied once into its own tensor."""
    runs: list[tuple[int, list[np.ndarray]]] = []
    for t in parts:
        data = _rows(t, arch, config)
        rows = data.reshape(data.shape[0], -1)  # [out, row_bytes] blocks, as stored
        if runs and runs[-1][0] == int(t.tensor_type):
            runs[-1][1].append(rows)
        else:
            runs.append((int(t.tensor_type), [rows]))
    out = [(ggml_type, packed_rows(rows)) for ggml_type, rows in runs]
    for t in parts:
        release_mapped_pages(t.data)
    return out


_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4  # <sys/mman.h>, Linux


def release_mapped_pages(array: np.ndarray) -> None:
    """Drop the pages of `array`, a view of a GGUF reader's read-only file mapping, from this process once its
    blocks are copied (a later read maps them again from the page cache). Without it a loading model's
    resident size is the file twice: every page of the mapping it has read, plus the copies.
    Anything that is not inside a file mapping (an unpermuted copy, anonymous memory) is left alone."""
    base = array
    while base is not None and not isinstance(base, np.memmap):
        base = base.base
    if base is None or sys.platform != "linux" or getattr(base, "_mmap", None) is None:
        return
    lo, hi = base.ctypes.data, base.ctypes.data + base.nbytes
    start, end = array.ctypes.data, array.ctypes.data + array.nbytes
    if not (lo <= start and end <= hi):
        return
    first = (start // _PAGE) * _PAGE
    if first < lo - lo % _PAGE:
        return
    length = ((min(end, hi) - first) // _PAGE) * _PAGE  # (a last partial page stays mapped)
    if length > 0:
        ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), _MADV_DONTNEED)
