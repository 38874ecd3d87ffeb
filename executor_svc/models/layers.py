"""The layers the model families are assembled from, each as transformers computes it.

A family file (`gemma2.py`, `qwen3.py`, ...) reads its Hugging Face config into a
`FamilyConfig` -- the Llama shape plus the switches below -- and the one `FamilyDecoder`
builds from it. The checkpoint's names map onto merged projections as for Llama
(`weight_target`), experts onto one tensor per expert kind::

    model.layers.N.self_attn.{q,k,v}_proj      -> layers.N.self_attn.qkv_proj   rows [q | k | v]
    model.layers.N.self_attn.qkv_proj (Phi-3)  -> the same, already merged
    model.layers.N.mlp.{gate,up}_proj          -> layers.N.mlp.gate_up_proj     rows [gate | up]
    model.layers.N.mlp.experts.E.{gate,up}_proj (Qwen3-MoE),
    model.layers.N.block_sparse_moe.experts.E.{w1,w3} (Mixtral)
                                               -> layers.N.mlp.experts_gate_up[E] rows [gate | up]
    ...experts.E.down_proj / w2                -> layers.N.mlp.experts_down[E]

A layer's output is returned as (hidden, residual), their sum the layer's output (the
residual add of the next norm), as `DecoderModel` does.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.attention.base import AttentionBackend, AttentionMetadata
from executor_svc.model import ModelConfig, PackedLinear, TensorParallel, apply_rotary


@dataclass(frozen=True)
class FamilyConfig(ModelConfig):
    """A Llama-shaped config plus what the other families change."""

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


def activation(name: str):
    if name == "silu":
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"activation {name!r}")


class RMSNorm(nn.Module):
    """Llama's (`weight * normed.to(dtype)`) or Gemma's (`(normed * (1 + weight)).to(dtype)`, float32)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, gemma: bool) -> None:
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


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None):
    """Neox rotary on the first `rotary_dim` of head_dim (all of it when None); the rest passes."""
    if rotary_dim is None or rotary_dim == q.shape[-1]:
        return apply_rotary(q, k, cos, sin)
    q_rot, k_rot = apply_rotary(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin)
    return torch.cat((q_rot, q[..., rotary_dim:]), dim=-1), torch.cat((k_rot, k[..., rotary_dim:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: FamilyConfig, dtype: torch.dtype, sliding_window: int | None) -> None:
        super().__init__()
        self.config = c
        self.sliding_window = sliding_window
        self.qkv_proj = nn.Linear(c.hidden_size, c.q_size + 2 * c.kv_size, bias=c.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(c.q_size, c.hidden_size, bias=c.o_bias, dtype=dtype)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, c.gemma_norm)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, c.gemma_norm)
        self.scale = c.attn_scale if c.attn_scale is not None else c.head_dim**-0.5

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, attention: AttentionBackend) -> torch.Tensor:
        c = self.config
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split((c.q_size, c.kv_size, c.kv_size), dim=-1)
        q = q.reshape(num_tokens, c.num_heads, c.head_dim)
        k = k.reshape(num_tokens, c.num_kv_heads, c.head_dim)
        v = v.reshape(num_tokens, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, k, cos, sin, c.rotary_dim)
        options = {}
        if self.sliding_window is not None:
            options["sliding_window"] = self.sliding_window
        if c.attn_logit_softcap is not None:
            options["logits_soft_cap"] = c.attn_logit_softcap
        out = attention.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, **options)
        return self.o_proj(out.reshape(num_tokens, c.q_size))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU (gelu, tanh approximation)."""

    def __init__(self, c: FamilyConfig, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * intermediate_size, bias=c.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, c.hidden_size, bias=c.mlp_bias, dtype=dtype)
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class SparseMoE(nn.Module):
    """Router softmax (float32) -> top-k -> renormalised if `norm_topk_prob`; then the experts.

    Two routes to the same numbers: the Triton fused-MoE kernel (`kernels.fused_moe`: two grouped
    GEMM launches over the tokens sorted by expert, fp32 accumulation) or the expert loop (one
    matmul pair per expert hit, weighted, summed in expert order). `fused` picks: None (the
    default) takes the kernel for CUDA tensors when Triton is installed, the loop otherwise;
    True or False forces one (True on CPU tensors runs the kernel in Triton's interpreter).
    """

    def __init__(self, c: FamilyConfig, dtype: torch.dtype, fused: bool | None = None) -> None:
        super().__init__()
        self.config = c
        self.fused = fused
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False, dtype=dtype)
        inter = c.moe_intermediate_size
        self.experts_gate_up = nn.Parameter(torch.empty(c.num_experts, 2 * inter, c.hidden_size, dtype=dtype))
        self.experts_down = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, inter, dtype=dtype))
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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


class FamilyLayer(nn.Module):
    def __init__(self, c: FamilyConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        self.config = c
        self.sliding_window = c.layer_windows[index]
        # Gemma 3: a sliding layer's own RoPE, even where its window covers every position
        self.local_rope = c.local_inv_freq is not None and c.layer_types is not None and c.layer_types[index] == "sliding_attention"
        self.self_attn = Attention(c, dtype, self.sliding_window)
        sparse = c.sparse_layers is not None and c.sparse_layers[index]
        self.mlp = SparseMoE(c, dtype) if sparse else GatedMLP(c, c.intermediate_size, dtype)
        norm = lambda: RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.gemma_norm)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if c.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, hidden, residual, cos, sin, kv_cache, meta, attention) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden if residual is None else residual + hidden
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, attention)
        if self.config.sandwich_norms:
            x = x + self.post_attention_layernorm(h)
            return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), x
        x = x + h
        return self.mlp(self.post_attention_layernorm(x)), x


def rotary_tables(inv_freq: tuple[float, ...], scaling: float, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, len(inv_freq)] in float32, as transformers computes them."""
    freq = torch.tensor(inv_freq, dtype=torch.float32, device=device)
    positions = torch.arange(max_positions, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * freq[None, :]
    return freqs.cos() * scaling, freqs.sin() * scaling


class FamilyDecoder(nn.Module):
    """Embedding (scaled for Gemma), `FamilyLayer`s, final norm, LM head (soft-capped for Gemma 2).

    The same interface as `DecoderModel` (forward -> (hidden, residual), compute_logits);
    no tensor parallelism, no fused ops but the MoE kernel on CUDA (`SparseMoE`), no CPU decode path.
    """

    def __init__(self, config: FamilyConfig, dtype: torch.dtype = torch.float32, tp: TensorParallel | None = None) -> None:
        super().__init__()
        if tp is not None and tp.size > 1:
            raise ValueError(f"{config.architecture}: no tensor parallelism")
        self.config = config
        self.tp = TensorParallel()
        self.ops = None  # (set by the backend; the family layers use plain torch)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(FamilyLayer(config, dtype, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, config.gemma_norm)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        )
        for name in ("rotary_cos", "rotary_sin", "local_cos", "local_sin"):
            self.register_buffer(name, torch.empty(0), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def init_buffers(self) -> None:
        c = self.config
        self.rotary_cos, self.rotary_sin = rotary_tables(c.inv_freq, c.rope_attention_scaling, c.max_position_embeddings, self.device)
        if c.local_inv_freq is not None:
            self.local_cos, self.local_sin = rotary_tables(
                c.local_inv_freq, c.local_rope_attention_scaling, c.max_position_embeddings, self.device
            )

    def pack_for_cpu(self) -> None:
        """Every projection and the LM head as a `PackedLinear` (see `executor_svc.model.can_pack_for_cpu`)."""
        for layer in self.layers:
            for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                linear = getattr(owner, name, None)
                if type(linear) is nn.Linear:
                    setattr(owner, name, PackedLinear(linear.weight, linear.bias))
        if self.lm_head is None or type(self.lm_head) is nn.Linear:
            self.lm_head = PackedLinear(self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight, None)

    def forward(self, input_ids, positions, kv_caches, meta, attention) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        layer_metas = meta if isinstance(meta, tuple) else (meta,) * len(self.layers)
        hidden = self.embed_tokens(input_ids)
        if c.embed_scale is not None:
            hidden = hidden * torch.tensor(c.embed_scale, dtype=hidden.dtype)
        tables = {None: (self.rotary_cos.index_select(0, positions), self.rotary_sin.index_select(0, positions))}
        if c.local_inv_freq is not None:
            tables["local"] = (self.local_cos.index_select(0, positions), self.local_sin.index_select(0, positions))
        residual = None
        for layer, kv_cache, layer_meta in zip(self.layers, kv_caches, layer_metas, strict=True):
            cos, sin = tables["local" if layer.local_rope else None]
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, layer_meta, attention)
        return hidden, residual

    def compute_logits(self, hidden, residual, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm + LM head (+ Gemma 2's soft cap) on the rows `logits_indices`; float32 out."""
        if logits_indices is not None:
            hidden, residual = hidden[logits_indices], residual[logits_indices]
        norm = self.norm
        if (
            self.ops is not None and hidden.device.type == "cpu"
            and hidden.dtype == torch.float32 and norm.weight.dtype == torch.float32
        ):  # the backend's C ops (CPU, float32): one call instead of RMSNorm's eight torch ops
            weight = 1.0 + norm.weight if norm.gemma else norm.weight  # Gemma's scale 1 + w, in float32 as its norm
            x, _ = self.ops.add_rms_norm(hidden, residual, weight, norm.eps)
        else:
            x = norm(residual + hidden)
        logits = F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_EXPERT = {"gate_proj": ("experts_gate_up", 0), "up_proj": ("experts_gate_up", 1), "down_proj": ("experts_down", None),
           "w1": ("experts_gate_up", 0), "w3": ("experts_gate_up", 1), "w2": ("experts_down", None)}


def weight_target(name: str, config: FamilyConfig):
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
