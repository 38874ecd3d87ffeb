"""Reading a Hugging Face config into the fields every family shares (`ModelConfig`'s)."""

from __future__ import annotations

from typing import Any

import torch

from executor_svc.kv_cache_spec import layer_sliding_windows

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def unsupported(message: str) -> Exception:
    from executor_svc.loader import UnsupportedModelError

    return UnsupportedModelError(message)


def rope(hf, head_dim: int, layer_type: str | None = None) -> tuple[tuple[float, ...], float, int]:
    """(inverse frequencies, attention scaling, rotary dim) through transformers' own RoPE initialisers.

    `layer_type`: Gemma 3's per-layer-type parameters (`rope_parameters[layer_type]`)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise unsupported(f"rope_type {rope_type!r} is not supported (expected one of {STATIC_ROPE_TYPES})")
    factor = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None)) or 1.0
    dim = int(head_dim * factor)
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return tuple(inv_freq.tolist()), 1.0, dim
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"), **kwargs)
    return tuple(inv_freq.float().tolist()), float(scaling), 2 * inv_freq.shape[0]


def base_fields(hf, architecture: str, *, qkv_bias: bool | None = None, o_bias: bool | None = None) -> dict[str, Any]:
    """`ModelConfig`'s fields (but the RoPE ones) from a Hugging Face config, checked."""
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    if hf.num_attention_heads % num_kv_heads:
        raise unsupported(
            f"num_attention_heads {hf.num_attention_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
        )
    eos = hf.eos_token_id
    attention_bias = bool(getattr(hf, "attention_bias", False))
    windows = layer_sliding_windows(hf)
    window = next((w for w in windows if w is not None), None)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is None:
        layer_types = ["sliding_attention" if w is not None else "full_attention" for w in windows]
    return dict(
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
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
        o_bias=attention_bias if o_bias is None else o_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        sliding_window=window,
        eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,),
        layer_types=tuple(layer_types),
    )


def rope_fields(hf, head_dim: int) -> dict[str, Any]:
    inv_freq, scaling, dim = rope(hf, head_dim)
    return dict(inv_freq=inv_freq, rope_attention_scaling=scaling, rotary_dim=None if dim == head_dim else dim)


def check_activation(hf, *names: str, field: str = "hidden_act") -> str:
    act = getattr(hf, field, None) or getattr(hf, "hidden_act", None)
    if act not in names:
        raise unsupported(f"{field} {act!r}: expected one of {names}")
    return act
