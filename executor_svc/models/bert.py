"""BERT and XLM-RoBERTa encoders (the pooling runner's), over a flat, unpadded batch of whole inputs.

    input_ids [T], token_type_ids [T], lengths (one per input)  ->  hidden states [T, hidden]

Embeddings (word + absolute position + token type, then LayerNorm), then post-LayerNorm layers:
bidirectional self-attention within each input (`attention.varlen`), residual, LayerNorm; a GELU
(erf) MLP, residual, LayerNorm. XLM-RoBERTa is BERT with positions counted after its padding
index (transformers' `create_position_ids_from_input_ids`: `padding_idx + 1 + i` for the i-th
non-pad token). The classification heads of cross-encoders read the first token's state:
`BertForSequenceClassification` through its pooler (dense + tanh) then `classifier`,
`XLMRobertaForSequenceClassification` through `classifier.dense` + tanh then `classifier.out_proj`.

Checkpoint names (a `bert.` / `roberta.` prefix is dropped; old `LayerNorm.gamma/beta` too)::

    embeddings.{word,position,token_type}_embeddings, embeddings.LayerNorm
    encoder.layer.N.attention.self.{query,key,value}  -> layers.N.qkv   rows [q | k | v]
    encoder.layer.N.attention.output.dense            -> layers.N.attn_out
    encoder.layer.N.attention.output.LayerNorm        -> layers.N.attn_norm
    encoder.layer.N.intermediate.dense                -> layers.N.up
    encoder.layer.N.output.dense                      -> layers.N.down
    encoder.layer.N.output.LayerNorm                  -> layers.N.out_norm
    pooler.dense, classifier(.dense, .out_proj)       -> head.*
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from executor_svc.attention.varlen import VarlenPlan, varlen_attention_packed

ARCHITECTURES = {
    "BertModel": ("bert", None),
    "BertForSequenceClassification": ("bert", "bert"),
    "XLMRobertaModel": ("xlm-roberta", None),
    "XLMRobertaForSequenceClassification": ("xlm-roberta", "roberta"),
}
ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def _unsupported(message: str) -> Exception:
    from executor_svc.loader import UnsupportedModelError

    return UnsupportedModelError(message)


@dataclass(frozen=True)
class EncoderConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int
    head: str | None  # None (embeddings), "bert" (pooler + classifier) or "roberta" (dense + tanh + out_proj)
    num_labels: int = 0

    @property
    def roberta_positions(self) -> bool:
        return self.model_type == "xlm-roberta"

    @property
    def max_model_len(self) -> int:
        """The longest input: XLM-RoBERTa's positions start after its padding index."""
        if self.roberta_positions:
            return self.max_position_embeddings - self.pad_token_id - 1
        return self.max_position_embeddings


def read_config(model_dir: str | Path) -> EncoderConfig:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    arch = (config.get("architectures") or [""])[0]
    if arch not in ARCHITECTURES:
        model_type = config.get("model_type")
        arch = {"bert": "BertModel", "xlm-roberta": "XLMRobertaModel"}.get(model_type, arch)
    if arch not in ARCHITECTURES:
        raise _unsupported(f"architecture {arch!r} is not an encoder the pooling runner runs (expected one of {list(ARCHITECTURES)})")
    model_type, head = ARCHITECTURES[arch]
    position_type = config.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise _unsupported(f"position_embedding_type {position_type!r}: only absolute positions are supported")
    act = config.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise _unsupported(f"hidden_act {act!r}: expected one of {list(ACTIVATIONS)}")
    if config.get("is_decoder") or config.get("add_cross_attention"):
        raise _unsupported("a decoder BERT (is_decoder / add_cross_attention) is not an encoder")
    num_labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
    return EncoderConfig(
        architecture=arch,
        model_type=model_type,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        max_position_embeddings=config["max_position_embeddings"],
        type_vocab_size=config.get("type_vocab_size", 2),
        layer_norm_eps=config.get("layer_norm_eps", 1e-12),
        hidden_act=act,
        pad_token_id=config.get("pad_token_id") if config.get("pad_token_id") is not None else 0,
        head=head,
        num_labels=num_labels if head else 0,
    )


class EncoderLayer(nn.Module):
    def __init__(self, c: EncoderConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = c
        h = c.hidden_size
        self.qkv = nn.Linear(h, 3 * h, dtype=dtype)
        self.attn_out = nn.Linear(h, h, dtype=dtype)
        self.attn_norm = nn.LayerNorm(h, eps=c.layer_norm_eps, dtype=dtype)
        self.up = nn.Linear(h, c.intermediate_size, dtype=dtype)
        self.down = nn.Linear(c.intermediate_size, h, dtype=dtype)
        self.out_norm = nn.LayerNorm(h, eps=c.layer_norm_eps, dtype=dtype)
        self.act = ACTIVATIONS[c.hidden_act]
        self.head_dim = h // c.num_heads
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
        t, h = x.shape
        attn = varlen_attention_packed(self.qkv(x).view(t, 3, self.config.num_heads, self.head_dim), plan, self.scale)
        x = self.attn_norm(self.attn_out(attn.reshape(t, h)) + x)
        return self.out_norm(self.down(self.act(self.up(x))) + x)


class BertHead(nn.Module):
    """BertForSequenceClassification: pooler (dense + tanh on the first token), then classifier."""

    def __init__(self, c: EncoderConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.pooler = nn.Linear(c.hidden_size, c.hidden_size, dtype=dtype)
        self.classifier = nn.Linear(c.hidden_size, c.num_labels, dtype=dtype)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler(first)))


class RobertaHead(nn.Module):
    """XLMRobertaForSequenceClassification: dense + tanh on the first token (<s>), then out_proj."""

    def __init__(self, c: EncoderConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size, dtype=dtype)
        self.out_proj = nn.Linear(c.hidden_size, c.num_labels, dtype=dtype)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first)))


class EncoderModel(nn.Module):
    def __init__(self, config: EncoderConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        c = self.config = config
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size, dtype=dtype)
        self.embed_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(EncoderLayer(c, dtype) for _ in range(c.num_layers))
        self.head = {None: None, "bert": BertHead, "roberta": RobertaHead}[c.head]
        if self.head is not None:
            self.head = self.head(c, dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_norm.weight.dtype

    def positions(self, input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Each token's position id: 0.. per input (BERT), or XLM-RoBERTa's count after the padding index."""
        starts = torch.tensor([0, *lengths[:-1]], device=input_ids.device).cumsum(0)
        lens = torch.tensor(lengths, device=input_ids.device)
        seq_start = torch.repeat_interleave(starts, lens)
        if not self.config.roberta_positions:
            return torch.arange(input_ids.shape[0], device=input_ids.device) - seq_start
        pad = self.config.pad_token_id
        mask = (input_ids != pad).long()
        count = mask.cumsum(0)
        before = torch.repeat_interleave(count[starts] - mask[starts], lens)  # non-pads before each input
        return (count - before) * mask + pad

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The last layer's hidden states [T, hidden]."""
        plan = VarlenPlan(lengths, input_ids.device)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(self.positions(input_ids, lengths))
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, plan)
        return x

    def classify(self, first_hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits [n, num_labels] from each input's first token state."""
        return self.head(first_hidden)


def weight_target(name: str, c: EncoderConfig) -> tuple[str, int | None] | None:
    """(parameter, first row or None) of a checkpoint tensor; None to skip it."""
    name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
    for prefix in ("bert.", "roberta.", "model."):
        name = name.removeprefix(prefix)
    if name.endswith(("position_ids", "token_type_ids")) or name.startswith(("cls.", "lm_head.")):
        return None
    parts = name.split(".")
    if parts[0] == "embeddings":
        kind = parts[1]
        target = "embed_norm" if kind == "LayerNorm" else kind
        return f"{target}.{parts[-1]}", None
    if parts[0] == "pooler":
        return (f"head.pooler.{parts[-1]}", None) if c.head == "bert" else None
    if parts[0] == "classifier":
        if c.head == "bert":
            return f"head.classifier.{parts[-1]}", None
        if c.head == "roberta":
            return f"head.{parts[1]}.{parts[-1]}", None
        return None
    if parts[0] == "encoder" and parts[1] == "layer":
        layer, rest, leaf = parts[2], ".".join(parts[3:-1]), parts[-1]
        h = c.hidden_size
        table = {
            "attention.self.query": ("qkv", 0),
            "attention.self.key": ("qkv", h),
            "attention.self.value": ("qkv", 2 * h),
            "attention.output.dense": ("attn_out", None),
            "attention.output.LayerNorm": ("attn_norm", None),
            "intermediate.dense": ("up", None),
            "output.dense": ("down", None),
            "output.LayerNorm": ("out_norm", None),
        }
        if rest in table:
            target, row = table[rest]
            return f"layers.{layer}.{target}.{leaf}", row
    return name, None  # no place: fill() names it


def load_encoder(model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> EncoderModel:
    """Build the encoder of the folder (no random init) and fill it from its safetensors."""
    from executor_svc.loader import UnsupportedModelError, weight_files

    c = read_config(model_dir)
    with torch.device("meta"):
        model = EncoderModel(c, dtype)
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    filled = dict.fromkeys(params, 0)
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                target = weight_target(name, c)
                if target is None:
                    continue
                param_name, row = target
                if param_name not in params:
                    raise UnsupportedModelError(f"{path.name}: tensor {name} has no place in the model")
                tensor = f.get_tensor(name)
                dest = params[param_name].data
                if row is not None:
                    dest = dest.narrow(0, row, tensor.shape[0])
                if dest.shape != tensor.shape:
                    raise UnsupportedModelError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
                dest.copy_(tensor)
                filled[param_name] += tensor.numel()
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise UnsupportedModelError(f"checkpoint {model_dir} does not fill {len(missing)} tensors, e.g. {missing[:3]}")
    return model.eval()


def hf_tensor_names(c: EncoderConfig) -> list[str]:
    """The checkpoint names of a `BertModel` of config `c` (module names, without .weight / .bias)."""
    embeddings = ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm")
    names = [f"embeddings.{n}" for n in embeddings]
    for i in range(c.num_layers):
        names += [f"encoder.layer.{i}.{n}" for n in (
            "attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
            "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm")]
    return names


def load_encoder_gguf(gguf_path: str | Path, model_dir: str | Path, device: torch.device,
                      dtype: torch.dtype) -> EncoderModel:
    """The encoder of a `bert` GGUF file (llama.cpp's converter's layout: BERT, or XLM-RoBERTa with
    its reranker head as `cls` / `cls.output`), its config the metadata folder's
    (`pagoda.gguf_pooling`). Each tensor is found through the `gguf` package's name map
    (BERT's checkpoint name -> `token_embd`, `blk.N.attn_q`, ...) and dequantized into `dtype` (F32,
    F16, Q8_0 and every type `gguf.quants` dequantizes); a tensor of the file with no place in the
    model, or one the model lacks, is refused by name."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from executor_svc.loader import UnsupportedModelError

    c = read_config(model_dir)
    if c.head == "bert":
        raise UnsupportedModelError(f"{Path(gguf_path).name}: GGUF BERT classifiers are not served (the converter "
                                    "drops their pooler.dense)")
    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, c.num_layers)
    with torch.device("meta"):
        model = EncoderModel(c, dtype)
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    filled = dict.fromkeys(params, 0)
    used = set()
    modules = hf_tensor_names(c)
    if c.head == "roberta":  # -> cls, cls.output
        modules += ["classifier.dense", "classifier.out_proj"]
    # XLM-RoBERTa: the converter cut the rows before padding_idx + 1 off position_embd (no input
    # uses row 0; a <pad> token inside an input takes row padding_idx, which transformers keeps at zero)
    position_offset = c.pad_token_id + 1 if c.roberta_positions else 0
    for hf_module in modules:
        base = name_map.get_name(hf_module)
        if base is None:
            raise UnsupportedModelError(f"the gguf package maps no tensor for {hf_module}")
        for suffix in ("weight", "bias"):
            t = tensors.get(f"{base}.{suffix}")
            if t is None:
                continue
            used.add(t.name)
            param_name, row = weight_target(f"{hf_module}.{suffix}", c)
            values = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
            dest = params[param_name].data
            if row is not None:
                dest = dest.narrow(0, row, values.shape[0])
            if hf_module == "embeddings.position_embeddings" and position_offset:
                dest[:position_offset].zero_()
                filled[param_name] += dest[:position_offset].numel()
                dest = dest[position_offset:]
            if dest.shape != values.shape:
                raise UnsupportedModelError(f"{Path(gguf_path).name}: {t.name} of shape {tuple(values.shape)}, "
                                            f"expected {tuple(dest.shape)}")
            dest.copy_(values)
            filled[param_name] += values.numel()
    extra = sorted(set(tensors) - used)
    if extra:
        raise UnsupportedModelError(f"{Path(gguf_path).name}: GGUF tensor {extra[0]} has no place in a BERT encoder")
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise UnsupportedModelError(f"{Path(gguf_path).name} does not fill {len(missing)} tensors, e.g. {missing[:3]}")
    return model.eval()
