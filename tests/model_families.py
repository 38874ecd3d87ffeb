"""Tiny random models of every supported family, saved as Hugging Face folders for the tests.

`build_family(kind, out_dir, tokenizer_dir)` writes a transformers config of the family (hidden
64, 4 layers, the default model's vocabulary of 49152), random float32 weights as safetensors
(every 1-D weight -- norms, biases -- moved off its initial value, so a norm read as `w`
instead of `1 + w`, or a dropped bias, changes the outputs) and the default model's tokenizer
files (no hub). The sliding families attend within `WINDOW` tokens, so a prompt of a few
windows tests them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

WINDOW = 16
VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3", "gemma2", "gemma3")
SLIDING = ("mistral", "qwen2", "qwen3", "mixtral", "gemma2", "gemma3")  # families built with windows


def tiny_config(kind: str):
    import transformers as T

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    moe = dict(num_experts_per_tok=2)
    if kind == "llama":
        return T.LlamaConfig(**common, tie_word_embeddings=False)
    if kind == "mistral":  # every layer within the window
        return T.MistralConfig(**common, sliding_window=WINDOW, tie_word_embeddings=False)
    if kind == "qwen2":  # layers 0-1 full, 2-3 windowed; q/k/v bias
        return T.Qwen2Config(**common, use_sliding_window=True, max_window_layers=2, sliding_window=WINDOW,
                             layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2, tie_word_embeddings=True)
    if kind == "qwen3":  # q/k norms; layers 0-1 full, 2-3 windowed
        return T.Qwen3Config(**common, use_sliding_window=True, max_window_layers=2, sliding_window=WINDOW, tie_word_embeddings=True)
    if kind == "qwen3_moe":  # 4 experts, top 2 not renormalised; layer 1 a dense MLP
        return T.Qwen3MoeConfig(**common, **moe, num_experts=4, moe_intermediate_size=32, norm_topk_prob=False,
                                decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False)
    if kind == "mixtral":  # 4 experts, top 2 (always renormalised), every layer windowed
        return T.MixtralConfig(**common, **moe, num_local_experts=4, sliding_window=WINDOW, tie_word_embeddings=False)
    if kind == "phi3":  # merged qkv / gate_up in the checkpoint, half the head rotated
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        return T.Phi3Config(**common, rope_parameters=rope, tie_word_embeddings=False)
    if kind == "gemma2":  # alternating windowed / full, both soft caps
        return T.Gemma2Config(**common, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
                              final_logit_softcapping=8.0)
    if kind == "gemma3":  # three windowed layers (local RoPE base) then one full
        return T.Gemma3TextConfig(**common, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                  layer_types=["sliding_attention"] * 3 + ["full_attention"])
    raise ValueError(kind)


def build_family(kind: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a tiny random `kind` model with the tokenizer of `tokenizer_dir` into `out_dir`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed + FAMILIES.index(kind))
    model = AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, Path(out_dir) / name)
    return Path(out_dir)


def load_reference(model_dir: Path, **config_changes):
    """transformers' model of the folder, float32, eager attention (the soft caps' reference);
    `config_changes` (e.g. `sliding_window`) are set on its config first."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    for name, value in config_changes.items():
        setattr(config, name, value)
    return AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32, attn_implementation="eager").eval()
