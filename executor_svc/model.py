"""A Llama-family decoder over a flat, unpadded batch of tokens.

    input_ids [T], positions [T]  ->  hidden states [T, hidden]   (one row per scheduled token)
    compute_logits(hidden, residual, logits_indices)  ->  [len(logits_indices), vocab] float32

The final norm and the LM head run only on the rows that are sampled. q/k/v and gate/up
are merged projections (one matmul each); the elementwise ops (RMSNorm, residual add +
RMSNorm, rotary, SiLU-and-mul) are the small functions of `ModelOps`, so fused kernels
can replace them without touching the model. Attention goes through an
`AttentionBackend`, which also writes this step's K and V into the paged cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.attention.base import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read once from config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    inv_freq: tuple[float, ...]  # RoPE inverse frequencies, head_dim // 2 of them
    rope_attention_scaling: float  # multiplies cos and sin (yarn); 1.0 otherwise
    sliding_window: int | None  # the window of the layers whose `layer_types` is "sliding_attention"
    eos_token_ids: tuple[int, ...]
    # per layer "full_attention" / "sliding_attention" (transformers' names); None: every layer full
    layer_types: tuple[str, ...] | None = None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, None for full attention."""
        if self.layer_types is None or self.sliding_window is None:
            return (None,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, scaled in the input dtype (as transformers' LlamaRMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary (rotate_half) on q [T, H, D] and k [T, KVH, D]; cos, sin [T, D // 2]."""
    cos = cos.to(q.dtype).unsqueeze(1)
    sin = sin.to(q.dtype).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] on the last dim -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- tensor-parallel hook (see executor_svc/parallel) -------------------------------------
class TensorParallel:
    """A model's place in a tensor-parallel group; this default is a group of one (no-ops).

    With a group of N (`executor_svc.parallel.group.ProcessGroupTP`) the model holds its
    rank's share: heads, intermediate columns and vocabulary rows split N ways (its
    `ModelConfig` counts the rank's heads, see `executor_svc.parallel.sharding`).
    `all_reduce` sums the row-parallel outputs (o_proj, down_proj, the embedding) and
    `gather_logits` joins the vocabulary shards of the LM head on rank 0.
    """

    rank = 0
    size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_logits(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def min(self, value: int) -> int:
        return value


def vocab_parallel_embed(embed: nn.Module, input_ids: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Each rank looks up the ids in its vocabulary rows, zeros the others; the sum is the embedding."""
    if tp.size == 1:
        return embed(input_ids)
    rows = embed.num_embeddings
    local = input_ids - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    hidden = embed(local.masked_fill(outside, 0)).masked_fill_(outside.unsqueeze(-1), 0)
    return tp.all_reduce(hidden)


# ---- end of the tensor-parallel hook --------------------------------------------------------


@dataclass(frozen=True)
class ModelOps:
    """The swappable elementwise ops; the defaults are plain torch."""

    rms_norm: Callable[..., torch.Tensor] = rms_norm
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = add_rms_norm
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] = apply_rotary
    silu_and_mul: Callable[..., torch.Tensor] = silu_and_mul


class PackedLinear(nn.Module):
    """A linear layer whose weight is reordered once for oneDNN (CPU only).

    Much faster than `F.linear` for the small row counts of decode steps (about 1.8x at
    16 rows for fp32 on AVX-512), at the price of a weight that only this op can read.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_size_hint: int = 16) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def can_pack_for_cpu(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel, sliding_window: int | None = None) -> None:
        super().__init__()
        c = config
        self.config = c
        self.sliding_window = sliding_window
        self.tp = tp  # row-parallel o_proj and down_proj: one all-reduce each
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.qkv_proj = nn.Linear(c.hidden_size, c.q_size + 2 * c.kv_size, bias=c.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(c.q_size, c.hidden_size, bias=c.o_bias, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias, dtype=dtype)
        self.scale = c.head_dim**-0.5

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        attention: AttentionBackend,
        ops: ModelOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        num_tokens = hidden.shape[0]
        if residual is None:
            residual = hidden
            hidden = ops.rms_norm(hidden, self.input_layernorm.weight, c.rms_norm_eps)
        else:
            hidden, residual = ops.add_rms_norm(hidden, residual, self.input_layernorm.weight, c.rms_norm_eps)
        q, k, v = self.qkv_proj(hidden).split((c.q_size, c.kv_size, c.kv_size), dim=-1)
        q, k = ops.apply_rotary(
            q.view(num_tokens, c.num_heads, c.head_dim), k.view(num_tokens, c.num_kv_heads, c.head_dim), cos, sin
        )
        v = v.view(num_tokens, c.num_kv_heads, c.head_dim)
        if self.sliding_window is None:
            attn = attention.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        else:
            attn = attention.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, sliding_window=self.sliding_window)
        hidden = self.tp.all_reduce(self.o_proj(attn.reshape(num_tokens, c.q_size)))
        hidden, residual = ops.add_rms_norm(hidden, residual, self.post_attention_layernorm.weight, c.rms_norm_eps)
        hidden = self.tp.all_reduce(self.down_proj(ops.silu_and_mul(self.gate_up_proj(hidden))))
        return hidden, residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied to the embedding or not).

    Under tensor parallelism (`tp`) the embedding and the LM head hold the rank's
    `vocab_size // tp.size` rows; `config.vocab_size` stays the whole vocabulary.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        ops: ModelOps | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.ops = ops or ModelOps()
        self.tp = tp or TensorParallel()
        vocab_rows = config.vocab_size // self.tp.size
        self.embed_tokens = nn.Embedding(vocab_rows, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, self.tp, window) for window in config.layer_windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, vocab_rows, bias=False, dtype=dtype)
        )
        self.register_buffer("rotary_cos", torch.empty(0), persistent=False)
        self.register_buffer("rotary_sin", torch.empty(0), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # the embedding may be a quantized module without `.weight`

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def init_buffers(self) -> None:
        """Rotary tables [max_position_embeddings, head_dim // 2] in float32, as transformers computes them."""
        c = self.config
        inv_freq = torch.tensor(c.inv_freq, dtype=torch.float32, device=self.device)
        positions = torch.arange(c.max_position_embeddings, device=self.device, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        self.rotary_cos = freqs.cos() * c.rope_attention_scaling
        self.rotary_sin = freqs.sin() * c.rope_attention_scaling

    def pack_for_cpu(self) -> None:
        """Replace every projection and the LM head by a `PackedLinear` (see `can_pack_for_cpu`).

        A tied LM head gets its own packed copy of the embedding (which lookups still read).
        Layers held some other way (quantized) are left as they are.
        """
        for layer in self.layers:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                linear = getattr(layer, name)
                if type(linear) is nn.Linear:
                    setattr(layer, name, PackedLinear(linear.weight, linear.bias))
        if self.lm_head is None or type(self.lm_head) is nn.Linear:
            head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self.lm_head = PackedLinear(head, None)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata | tuple[AttentionMetadata, ...],
        attention: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden, residual), both [T, hidden]: their sum is the last layer's output.

        `meta`: one for every layer, or one per layer (each layer's KV cache group's).
        """
        layer_metas = meta if isinstance(meta, tuple) else (meta,) * len(self.layers)
        hidden = vocab_parallel_embed(self.embed_tokens, input_ids, self.tp)
        residual = None
        cos, sin = self.rotary_cos.index_select(0, positions), self.rotary_sin.index_select(0, positions)
        for layer, kv_cache, layer_meta in zip(self.layers, kv_caches, layer_metas, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, layer_meta, attention, self.ops)
        return hidden, residual

    def compute_logits(
        self, hidden: torch.Tensor, residual: torch.Tensor, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final norm + LM head on the rows `logits_indices` (all rows when None); float32 out."""
        if logits_indices is not None:
            hidden, residual = hidden[logits_indices], residual[logits_indices]
        hidden, _ = self.ops.add_rms_norm(hidden, residual, self.norm.weight, self.config.rms_norm_eps)
        if self.lm_head is None:
            return self.tp.gather_logits(F.linear(hidden, self.embed_tokens.weight).float())
        return self.tp.gather_logits(self.lm_head(hidden).float())
