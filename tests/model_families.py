"""Tiny random models of every supported family, saved as Hugging Face folders for the tests.

`build_family(kind, out_dir, tokenizer_dir)` writes a transformers config of the family (hidden
64, 4 layers, the default model's vocabulary of 49152), random float32 weights as safetensors
(every 1-D weight -- norms, biases -- moved off its initial value, so a norm read as `w`
instead of `1 + w`, or a dropped bias, changes the outputs) and the default model's tokenizer
files (no hub). The sliding families attend within `WINDOW` tokens, so a prompt of a few
windows tests them. `gemma3_mm` is `gemma3`'s text model inside a `Gemma3ForConditionalGeneration`
with a one-layer vision tower.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

WINDOW = 16
VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3", "gemma2", "gemma3", "gemma3_mm")
SLIDING = ("mistral", "qwen2", "qwen3", "mixtral", "gemma2", "gemma3", "gemma3_mm")  # families built with windows


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
    if kind == "gemma3_mm":  # Gemma3ForConditionalGeneration: gemma3's text model, a one-layer vision tower
        vision = T.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      image_size=28, patch_size=14)
        return T.Gemma3Config(text_config=tiny_config("gemma3").to_dict(), vision_config=vision.to_dict(),
                              mm_tokens_per_image=4, eos_token_id=common["eos_token_id"])
    raise ValueError(kind)


def build_family(kind: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0, **config_changes) -> Path:
    """Save a tiny random `kind` model (its config changed by `config_changes`) with the tokenizer
    of `tokenizer_dir` into `out_dir`."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(kind)
    for name, value in config_changes.items():
        setattr(config.get_text_config(), name, value)
    torch.manual_seed(seed + FAMILIES.index(kind))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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
    `config_changes` (e.g. `sliding_window`) are set on its (text) config first."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    for name, value in config_changes.items():
        setattr(config.get_text_config(), name, value)
    return AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32, attn_implementation="eager").eval()


# GGUF files: the families transformers reads from GGUF (`transformers.integrations.ggml`), with
# the GGUF architecture name llama.cpp's converter writes
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3"}
# the MoE families, which transformers cannot read from GGUF (Qwen3-MoE: no `moe_intermediate_size`;
# Mixtral, a "llama" file with experts: the experts dropped), and what their reference folder (see
# `write_gguf`) is built with: what llama.cpp computes -- no dense layers, the top-k renormalised, no window
MOE_GGUF_ARCHITECTURES = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}
MOE_GGUF_CONFIG = {"qwen3_moe": {"norm_topk_prob": True, "mlp_only_layers": []}, "mixtral": {"sliding_window": None}}
# what a GGUF file cannot say, so that transformers' reading of it keeps the tensors' shapes
GGUF_CONFIG = {"qwen3": {"head_dim": 128}}  # (transformers' Qwen3 GGUF config takes the default head_dim)
# the block type of each 2-D GGUF tensor (the rest, norms and biases, float32): q/k and v of two
# types (a merged projection of two segments), a type of its own for the embedding and the head
GGUF_TYPES = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q4_1", "attn_qkv": "Q8_0", "attn_output": "Q5_0",
              "ffn_gate": "Q5_1", "ffn_up": "Q5_1", "ffn_down": "Q4_0", "token_embd": "Q8_0", "output": "Q4_1",
              "ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q5_0", "ffn_down_exps": "Q4_1"}  # (the router, ffn_gate_inp: F32)


def write_gguf(kind: str, model_dir: Path, out_path: Path, reference_dir: Path | None = None) -> Path:
    """The folder's model as a GGUF file, written as llama.cpp's converter does: the `gguf` package's
    tensor names, q/k rows permuted for "llama", Gemma's norm weights stored as 1 + w, each
    layer's experts stacked into one [experts, out, in] tensor per projection, every 2-D or 3-D
    weight quantized by the `gguf` package to its type of `GGUF_TYPES`, the rest float32.
    No tokenizer (reading 49152 tokens and their merges from a GGUF file takes seconds each
    time): `gguf_model_dir` gives the runner the folder's tokenizer files instead.

    `reference_dir`: also the folder again with the weights the file holds -- each tensor
    quantized and dequantized by the `gguf` package (the blocks run along rows, so this is the
    file's tensor whatever its rows' permutation or stacking) -- the reference for the files
    transformers cannot read (`MOE_GGUF_ARCHITECTURES`)."""
    import gguf
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    arch = {**GGUF_ARCHITECTURES, **MOE_GGUF_ARCHITECTURES}[kind]
    assert reference_dir is None or kind in MOE_GGUF_ARCHITECTURES, kind  # (no Gemma 1 + w undone there)
    config = AutoConfig.from_pretrained(model_dir)
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    reference: dict[str, torch.Tensor] = {}
    w = gguf.GGUFWriter(str(out_path), arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(float((config.rope_parameters.get("full_attention") or config.rope_parameters)["rope_theta"]))
    w.add_vocab_size(config.vocab_size)
    w.add_rope_dimension_count(config.head_dim)
    if kind.startswith("gemma"):
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
        w.add_sliding_window(config.sliding_window)
    if kind in MOE_GGUF_ARCHITECTURES:
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
        w.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        if kind == "qwen3_moe":
            w.add_expert_feed_forward_length(config.moe_intermediate_size)
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for name, tensor in _stacked_experts(tensors).items():
        data = tensor.float()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
        if kind.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        kind_of = gguf_name.removesuffix(".weight").rpartition(".")[2] if data.ndim >= 2 else None
        if kind_of in GGUF_TYPES:
            qtype = gguf.GGMLQuantizationType[GGUF_TYPES[kind_of]]
            w.add_tensor(gguf_name, gguf.quants.quantize(data.numpy(), qtype), raw_dtype=qtype)
            if reference_dir is not None:
                held = gguf.quants.dequantize(gguf.quants.quantize(tensor.float().numpy(), qtype), qtype)
                reference[name] = torch.from_numpy(held.copy())
        else:
            w.add_tensor(gguf_name, data.numpy())
            reference[name] = tensor.float()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if reference_dir is not None:
        Path(reference_dir).mkdir(parents=True, exist_ok=True)
        for file in Path(model_dir).iterdir():
            if file.suffix != ".safetensors":
                shutil.copy(file, Path(reference_dir) / file.name)
        save_file(_unstacked_experts(reference), str(Path(reference_dir) / "model.safetensors"), metadata={"format": "pt"})
    return out_path


def _stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`...experts.E.proj.weight` of every expert E as one `...experts.proj.weight` [experts, out, in]
    (as llama.cpp's converter merges them), in the place of the first; the other tensors as they are."""
    out: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    for name, tensor in tensors.items():
        before, sep, after = name.partition(".experts.")
        if sep:
            expert, _, proj = after.partition(".")
            group = out.setdefault(f"{before}.experts.{proj}", [])
            assert int(expert) == len(group), name
            group.append(tensor)
        else:
            out[name] = tensor
    return {name: torch.stack(t) if isinstance(t, list) else t for name, t in out.items()}


def _unstacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `_stacked_experts`: one tensor per expert, contiguous, as a checkpoint holds them."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        before, sep, proj = name.partition(".experts.")
        if sep:
            out.update({f"{before}.experts.{e}.{proj}": t.contiguous() for e, t in enumerate(tensor)})
        else:
            out[name] = tensor.contiguous()
    return out


def gguf_model_dir(gguf_path: Path, model_dir: Path, out_dir: Path) -> Path:
    """What `pagoda.model_files.gguf_metadata_dir` makes of a GGUF file -- transformers' config of
    it, tokenizer files, the marker naming the file as the weights -- with the tokenizer files
    of `model_dir` (the file has none)."""
    import json

    from transformers import AutoConfig

    from pagoda.model_files import GGUF_SOURCE

    AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, Path(out_dir) / name)
    marker = {"file": str(gguf_path.resolve()), "key": gguf_path.stem, "weights": "gguf"}
    (Path(out_dir) / GGUF_SOURCE).write_text(json.dumps(marker))
    return Path(out_dir)
