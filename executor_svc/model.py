"""The decoder every family runs on, over a flat, unpadded batch of tokens.

    input_ids [T], positions [T]  ->  hidden states [T, hidden]   (one row per scheduled token)
    compute_logits(hidden, residual, logits_indices)  ->  [len(logits_indices), vocab] float32

One `DecoderModel` built from the layers below: a family file (`executor_svc/models/`) reads its
Hugging Face config into a `ModelConfig` -- the Llama shape plus the switches of the other
families (Gemma's norms and soft caps, q/k norms, partial rotary, experts) -- and the decoder
builds from it. The final norm and the LM head run only on the rows that are sampled. q/k/v and
gate/up are merged projections (one matmul each); the elementwise ops (RMSNorm, residual add +
RMSNorm, rotary, SiLU-and-mul) are the small functions of `ModelOps`, so fused kernels (C on a
CPU, Triton on CUDA) replace them without touching the model, wherever a layer computes what
they compute (Llama's norm, whole-head rotary, SwiGLU); Gemma's norms, partial rotary and GeGLU
stay torch. Attention goes through an `AttentionBackend`, which also writes this step's K and V
into the paged cache. The checkpoint's names map onto the merged projections (`weight_target`),
experts onto one tensor per expert kind::

    model.layers.N.self_attn.{q,k,v}_proj      -> layers.N.self_attn.qkv_proj   rows [q | k | v]
    model.layers.N.self_attn.qkv_proj (Phi-3)  -> the same, already merged
    model.layers.N.mlp.{gate,up}_proj          -> layers.N.mlp.gate_up_proj     rows [gate | up]
    model.layers.N.mlp.experts.E.{gate,up}_proj (Qwen3-MoE),
    model.layers.N.block_sparse_moe.experts.E.{w1,w3} (Mixtral)
                                               -> layers.N.mlp.experts_gate_up[E] rows [gate | up]
    ...experts.E.down_proj / w2                -> layers.N.mlp.experts_down[E]

A layer returns (hidden, residual), their sum the layer's output: the next norm adds them
(one fused call where the ops are fused).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.attention.base import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder, read once from config.json: Llama's, plus what the other families change."""

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
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh" (GeGLU)
    gemma_norm: bool = False  # RMSNorm scale 1 + w, multiplied in float32 (Gemma)
    qk_norm: bool = False  # RMSNorm over head_dim of q and k before rotary (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and before/after the MLP (Gemma 2/3)
    embed_scale: float | None = None  # Gemma: sqrt(hidden_size), in the model's dtype
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_logit_softcap: float | None = None  # Gemma 2
    final_logit_softcap: float | None = None  # Gemma 2
    local_inv_freq: tuple[float, ...] | None = None  # sliding layers' RoPE (Gemma 3's local base)
    local_rope_attention_scaling: float = 1.0
    rotary_dim: int | None = None  # partial rotary (Phi-3): the first rotary_dim of head_dim
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    sparse_layers: tuple[bool, ...] | None = None  # which layers' MLP is the MoE block
    # a vision-language checkpoint's whole transformers config (its vision tower and projector are
    # built from it: executor_svc.vision); None for a text model
    multimodal: Any = field(default=None, compare=False, repr=False)
    image_bidirectional: bool = False  # an image's tokens attend to each other both ways (Gemma 3)
    # Qwen2.5-VL's multimodal rotary: how many of the head_dim // 2 frequencies turn with the
    # (time, height, width) positions; positions are then [3, T]
    mrope_section: tuple[int, ...] | None = None

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
    """oneDNN packs float32 weights on any x86 CPU, bfloat16 ones only where it has bfloat16 arithmetic
    (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX: not on an AVX2-only CPU, where the reorder raises)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class RMSNorm(nn.Module):
    """Llama's (`weight * normed.to(dtype)`) or Gemma's (`(normed * (1 + weight)).to(dtype)`, float32).

    `norm` and `add_norm` take the model's ops: Llama's norm is theirs (fused where they are),
    Gemma's is this module's own."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def norm(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        return self(x) if self.gemma else ops.rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None, ops: ModelOps) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); (norm(x), x) without a residual."""
        if residual is None:
            return self.norm(x, ops), x
        if self.gemma:
            residual = x + residual
            return self(residual), residual
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


def rotary(q, k, cos, sin, rotary_dim: int | None, ops: ModelOps) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary on the first `rotary_dim` of head_dim (all of it when None: the ops'); the rest passes."""
    if rotary_dim is None or rotary_dim == q.shape[-1]:
        return ops.apply_rotary(q, k, cos, sin)
    q_rot, k_rot = apply_rotary(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin)
    return torch.cat((q_rot, q[..., rotary_dim:]), dim=-1), torch.cat((k_rot, k[..., rotary_dim:]), dim=-1)


def activation(name: str):
    if name == "silu":
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"activation {name!r}")


class Attention(nn.Module):
    """q/k/v (one matmul), q/k norms, rotary, paged attention, o_proj (row-parallel: one all-reduce)."""

    def __init__(self, c: ModelConfig, dtype: torch.dtype, sliding_window: int | None, tp: TensorParallel) -> None:
        super().__init__()
        self.config = c
        self.sliding_window = sliding_window
        self.tp = tp
        self.qkv_proj = nn.Linear(c.hidden_size, c.q_size + 2 * c.kv_size, bias=c.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(c.q_size, c.hidden_size, bias=c.o_bias, dtype=dtype)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, c.gemma_norm)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, c.gemma_norm)
        self.scale = c.attn_scale if c.attn_scale is not None else c.head_dim**-0.5
        self.options = {}  # the attention backend's keywords of this layer
        if sliding_window is not None:
            self.options["sliding_window"] = sliding_window
        if c.attn_logit_softcap is not None:
            self.options["logits_soft_cap"] = c.attn_logit_softcap

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, attention: AttentionBackend, ops: ModelOps):
        c = self.config
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split((c.q_size, c.kv_size, c.kv_size), dim=-1)
        q = q.view(num_tokens, c.num_heads, c.head_dim)
        k = k.view(num_tokens, c.num_kv_heads, c.head_dim)
        v = v.view(num_tokens, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, k, cos, sin, c.rotary_dim, ops)
        out = attention.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, **self.options)
        if meta is not None and meta.image_spans:  # (a pooling model's attention runs without metadata)
            out = image_attention(out.view(num_tokens, c.num_heads, c.head_dim), q, kv_cache, meta, self.scale, self.sliding_window)
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, c.q_size)))


def image_attention(out, q, kv_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
    """`out` with the rows of queries inside an image (`meta.image_spans`) attended again, to every
    key before the image's end: transformers' Gemma 3 mask OR(causal, same image), AND its sliding
    window (key j > position - window) on a sliding layer. Their K and V are in the cache already
    (the backend wrote this step's), read through the block table."""
    k_cache, v_cache = kv_cache
    block_size, kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    out = out.clone()
    for seq, row, num_rows, first_position, end in meta.image_spans:
        keys = torch.arange(end, device=q.device)
        slots = meta.block_table[seq, keys // block_size].long() * block_size + keys % block_size
        k = k_cache.view(-1, kv_heads, head_dim)[slots].to(q.dtype).transpose(0, 1)  # [KVH, end, D]
        v = v_cache.view(-1, kv_heads, head_dim)[slots].to(q.dtype).transpose(0, 1)
        query = q[row : row + num_rows].transpose(0, 1)  # [H, Q, D]
        mask = None
        if sliding_window is not None:
            positions = torch.arange(first_position, first_position + num_rows, device=q.device)
            mask = keys[None, :] > positions[:, None] - sliding_window
        rows = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=kv_heads != q.shape[1])
        out[row : row + num_rows] = rows.transpose(0, 1)
    return out


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu, the ops') or GeGLU (gelu, tanh approximation);
    down_proj row-parallel (one all-reduce)."""

    def __init__(self, c: ModelConfig, intermediate_size: int, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.tp = tp
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * intermediate_size, bias=c.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, c.hidden_size, bias=c.mlp_bias, dtype=dtype)
        self.silu = c.hidden_act == "silu"
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        if self.silu:
            h = ops.silu_and_mul(self.gate_up_proj(x))
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            h = self.act(gate) * up
        return self.tp.all_reduce(self.down_proj(h))


class SparseMoE(nn.Module):
    """Router softmax (float32) -> top-k -> renormalised if `norm_topk_prob`; then the experts.

    Two routes to the same numbers: the Triton fused-MoE kernel (`kernels.fused_moe`: two grouped
    GEMM launches over the tokens sorted by expert, fp32 accumulation) or the expert loop (one
    matmul pair per expert hit, weighted, summed in expert order). `fused` picks: None (the
    default) takes the kernel for CUDA tensors when Triton is installed, the loop otherwise;
    True or False forces one (True on CPU tensors runs the kernel in Triton's interpreter).
    """

    def __init__(self, c: ModelConfig, dtype: torch.dtype, fused: bool | None = None) -> None:
        super().__init__()
        self.config = c
        self.fused = fused
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False, dtype=dtype)
        inter = c.moe_intermediate_size
        self.experts_gate_up = nn.Parameter(torch.empty(c.num_experts, 2 * inter, c.hidden_size, dtype=dtype))
        self.experts_down = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, inter, dtype=dtype))
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor, ops: ModelOps | None = None) -> torch.Tensor:
        c = self.config
        router_logits = self.gate(x)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(probs, c.num_experts_per_tok, dim=-1)
        if c.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        if self.fused if self.fused is not None else x.is_cuda and _triton_installed():
            from kernels.fused_moe import fused_moe

            return fused_moe(x, self.experts_gate_up, self.experts_down, top_weights, top_experts, c.hidden_act)
        top_weights = top_weights.to(router_logits.dtype)
        out = torch.zeros_like(x)
        for expert in torch.unique(top_experts).tolist():
            token_ids, slot = torch.where(top_experts == expert)
            gate, up = F.linear(x[token_ids], self.experts_gate_up[expert]).chunk(2, dim=-1)
            h = F.linear(self.act(gate) * up, self.experts_down[expert])
            out.index_add_(0, token_ids, h * top_weights[token_ids, slot, None])
        return out


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


class DecoderLayer(nn.Module):
    """Norm, attention, norm, MLP (dense or experts); Gemma's sandwich norms around both."""

    def __init__(self, c: ModelConfig, dtype: torch.dtype, index: int, tp: TensorParallel) -> None:
        super().__init__()
        self.config = c
        self.sliding_window = c.layer_windows[index]
        # Gemma 3: a sliding layer's own RoPE, even where its window covers every position
        self.local_rope = c.local_inv_freq is not None and c.layer_types is not None and c.layer_types[index] == "sliding_attention"
        self.self_attn = Attention(c, dtype, self.sliding_window, tp)
        sparse = c.sparse_layers is not None and c.sparse_layers[index]
        self.mlp = SparseMoE(c, dtype) if sparse else GatedMLP(c, c.intermediate_size, dtype, tp)
        norm = lambda: RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.gemma_norm)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if c.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(
        self, hidden, residual, cos, sin, kv_cache, meta: AttentionMetadata, attention: AttentionBackend, ops: ModelOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.add_norm(hidden, residual, ops)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, meta, attention, ops)
        if self.config.sandwich_norms:
            residual = residual + self.post_attention_layernorm(hidden)
            hidden = self.mlp(self.pre_feedforward_layernorm(residual), ops)
            return self.post_feedforward_layernorm(hidden), residual
        hidden, residual = self.post_attention_layernorm.add_norm(hidden, residual, ops)
        return self.mlp(hidden, ops), residual


def rotary_tables(inv_freq: tuple[float, ...], scaling: float, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, len(inv_freq)] in float32, as transformers computes them."""
    freq = torch.tensor(inv_freq, dtype=torch.float32, device=device)
    positions = torch.arange(max_positions, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * freq[None, :]
    return freqs.cos() * scaling, freqs.sin() * scaling


def mrope_table(table: torch.Tensor, positions: torch.Tensor, section: tuple[int, ...]) -> torch.Tensor:
    """[T, head_dim // 2]: the first section[0] columns at positions[0] (time), the next section[1]
    at positions[1] (height), the last at positions[2] (width), as transformers' Qwen2.5-VL rotary."""
    parts, start = [], 0
    for axis, width in enumerate(section):
        parts.append(table[:, start : start + width].index_select(0, positions[axis]))
        start += width
    return torch.cat(parts, dim=-1)


class DecoderModel(nn.Module):
    """Embedding (scaled for Gemma), decoder layers, final norm and LM head (tied to the embedding
    or not; soft-capped for Gemma 2).

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
        if self.tp.size > 1 and config.num_experts:
            raise ValueError(f"{config.architecture}: no tensor parallelism for mixture-of-experts layers")
        vocab_rows = config.vocab_size // self.tp.size
        self.embed_tokens = nn.Embedding(vocab_rows, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, i, self.tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, config.gemma_norm)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, vocab_rows, bias=False, dtype=dtype)
        )
        for name in ("rotary_cos", "rotary_sin", "local_cos", "local_sin"):
            self.register_buffer(name, torch.empty(0), persistent=False)
        self.lora = None  # the step's adapter rows where adapters are on (executor_svc.lora.LoraState)
        self.vision = None  # a vision-language model's tower and projector (executor_svc.vision.VisionEncoder)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # the embedding may be a quantized module without `.weight`

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def init_buffers(self) -> None:
        """Rotary tables [max_position_embeddings, rotary_dim // 2] in float32 (and the sliding layers' own)."""
        c = self.config
        self.rotary_cos, self.rotary_sin = rotary_tables(c.inv_freq, c.rope_attention_scaling, c.max_position_embeddings, self.device)
        if c.local_inv_freq is not None:
            self.local_cos, self.local_sin = rotary_tables(
                c.local_inv_freq, c.local_rope_attention_scaling, c.max_position_embeddings, self.device
            )

    def projections(self):
        """(owner, attribute) of every dense projection: q/k/v, o, gate/up, down of each layer."""
        for layer in self.layers:
            yield layer.self_attn, "qkv_proj"
            yield layer.self_attn, "o_proj"
            if isinstance(layer.mlp, GatedMLP):
                yield layer.mlp, "gate_up_proj"
                yield layer.mlp, "down_proj"

    def pack_for_cpu(self) -> None:
        """Replace every projection and the LM head by a `PackedLinear` (see `can_pack_for_cpu`).

        A tied LM head gets its own packed copy of the embedding (which lookups still read).
        Layers held some other way (quantized) are left as they are.
        """
        for owner, name in self.projections():
            linear = getattr(owner, name)
            if type(linear) is nn.Linear:
                setattr(owner, name, PackedLinear(linear.weight, linear.bias))
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
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden, residual), both [T, hidden]: their sum is the last layer's output.

        `meta`: one for every layer, or one per layer (each layer's KV cache group's).
        `mm_embeds`: (rows [N], embeddings [N, hidden]) of a vision-language model's step: the
        image features that replace the (scaled) embeddings of those rows' placeholder tokens.
        """
        c = self.config
        layer_metas = meta if isinstance(meta, tuple) else (meta,) * len(self.layers)
        if mm_embeds is not None:  # (a placeholder's id may lie outside the vocabulary: its row is replaced)
            input_ids = input_ids.index_fill(0, mm_embeds[0], 0)
        hidden = vocab_parallel_embed(self.embed_tokens, input_ids, self.tp)
        if c.embed_scale is not None:
            hidden = hidden * torch.tensor(c.embed_scale, dtype=hidden.dtype)
        if mm_embeds is not None:
            hidden = hidden.index_copy(0, mm_embeds[0], mm_embeds[1].to(hidden.dtype))
        if positions.ndim == 2:  # [3, T] multimodal rotary: each frequency's part turned by its position
            tables = (mrope_table(self.rotary_cos, positions, c.mrope_section), mrope_table(self.rotary_sin, positions, c.mrope_section))
        else:
            tables = (self.rotary_cos.index_select(0, positions), self.rotary_sin.index_select(0, positions))
        local = None
        if c.local_inv_freq is not None:
            local = (self.local_cos.index_select(0, positions), self.local_sin.index_select(0, positions))
        residual = None
        for layer, kv_cache, layer_meta in zip(self.layers, kv_caches, layer_metas, strict=True):
            cos, sin = local if layer.local_rope else tables
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, layer_meta, attention, self.ops)
        return hidden, residual

    def compute_logits(
        self, hidden: torch.Tensor, residual: torch.Tensor, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final norm + LM head (+ Gemma 2's soft cap) on the rows `logits_indices` (all rows when None); float32 out."""
        if logits_indices is not None:
            hidden, residual = hidden[logits_indices], residual[logits_indices]
        norm = self.norm
        if not norm.gemma:
            x, _ = self.ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        elif hidden.device.type == "cpu" and hidden.dtype == torch.float32 and norm.weight.dtype == torch.float32:
            # the ops' one call (C on a CPU) instead of RMSNorm's eight torch ops; Gemma's scale 1 + w, in float32 as its norm
            x, _ = self.ops.add_rms_norm(hidden, residual, 1.0 + norm.weight, norm.eps)
        else:
            x = norm(residual + hidden)
        logits = F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)
        logits = self.tp.gather_logits(logits)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_EXPERT = {"gate_proj": ("experts_gate_up", 0), "up_proj": ("experts_gate_up", 1), "down_proj": ("experts_down", None),
           "w1": ("experts_gate_up", 0), "w3": ("experts_gate_up", 1), "w2": ("experts_down", None)}


def weight_target(name: str, config: ModelConfig):
    """(parameter name, where) for a checkpoint tensor, None to skip it; `where` is None (the whole
    parameter), a first row, or (expert, first row or None) -- see the module docstring."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name.startswith("lm_head."):
        return None if config.tie_word_embeddings else (name, None)
    parts = name.removeprefix("model.").split(".")
    if parts[0] != "layers":
        return ".".join(parts), None
    layer, rest = parts[1], parts[2:]
    if rest[0] == "block_sparse_moe":
        rest = ["mlp", *rest[1:]]
    if rest[0] == "mlp" and rest[1] == "experts":  # mlp.experts.E.proj.weight
        merged, half = _EXPERT[rest[3]]
        row = None if half is None else half * config.moe_intermediate_size
        return f"layers.{layer}.mlp.{merged}", (int(rest[2]), row)
    if len(rest) == 3 and rest[1] in _STACKED:
        merged, index = _STACKED[rest[1]]
        owner = "self_attn" if merged == "qkv_proj" else "mlp"
        offsets = (0, config.q_size, config.q_size + config.kv_size) if merged == "qkv_proj" else (0, config.intermediate_size)
        return f"layers.{layer}.{owner}.{merged}.{rest[2]}", offsets[index]
    return f"layers.{layer}.{'.'.join(rest)}", None
