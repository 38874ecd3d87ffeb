"""The config of a mixture-of-experts GGUF file, read from its metadata (not by transformers).

transformers' GGUF reading cannot give these configs: its Qwen3-MoE config has no
`moe_intermediate_size`, and a Mixtral file -- llama.cpp writes Mixtral as architecture "llama"
with `llama.expert_count` > 0 and `blk.N.ffn_{gate,up,down}_exps` tensors -- reads as a Llama
without experts. So the keys llama.cpp's converter writes fill the family's Hugging Face config
class, which the family's `read_config` checks as any other::

    {arch}.block_count / embedding_length / context_length  -> num_hidden_layers / hidden_size / max_position_embeddings
    {arch}.attention.head_count / head_count_kv / key_length -> num_attention_heads / num_key_value_heads / head_dim
    {arch}.attention.layer_norm_rms_epsilon, rope.freq_base  -> rms_norm_eps, rope_theta
    {arch}.expert_count / expert_used_count                  -> num_experts / num_experts_per_tok
    {arch}.expert_feed_forward_length (qwen3moe), feed_forward_length (llama) -> each expert's size
    token_embd's rows, no `output` tensor                     -> vocab_size, tie_word_embeddings

What the config then says is what llama.cpp computes for these architectures (its
`build_moe_ffn` with softmax gating and `norm_w = true` for both): the top-k router weights are
always renormalised -- a Qwen3-MoE file is served with `norm_topk_prob` true whatever the
checkpoint's config said (the converter does not record it) -- every layer is a MoE block
(llama.cpp requires `ffn_gate_inp` on each), and there is no sliding window. Shared experts,
RoPE scaling and partial rotary are refused.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

# GGUF value types (gguf.GGUFValueType) -> struct format of the fixed-size ones; 8 string, 9 array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _is_moe(arch: str | None, llama_expert_count: int | None) -> bool:
    return arch == "qwen3moe" or (arch == "llama" and (llama_expert_count or 0) > 0)


def moe_hf_config(path: Path):
    """The Hugging Face config (`Qwen3MoeConfig` / `MixtralConfig`) of a MoE GGUF file; None for any other file."""
    from gguf import GGUFReader

    found = _scan(path, ("general.architecture", "llama.expert_count"))
    if not _is_moe(found.get("general.architecture"), found.get("llama.expert_count")):
        return None
    return _hf_config(GGUFReader(str(path)), path.name)


def _scan(path: Path, keys: tuple[str, ...]) -> dict:
    """The scalar or string values of `keys` from the file's metadata, read until all are found.

    `GGUFReader` builds every field, the tokenizer's ~10^5 strings included: 1.8-2.1 s for the
    default model's file (measured), which every GGUF model's `load_config` would pay; this scan
    skips them (13 ms there, the file cached)."""
    found: dict = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            return found
        (num_kv,) = struct.unpack_from("<Q", m, 16)  # after magic, version u32, tensor count u64
        pos = 24

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", m, at)
            return m[at + 8 : at + 8 + n].decode(), at + 8 + n

        def skip(value_type: int, at: int) -> int:
            if value_type in _SCALARS:
                return at + struct.calcsize(_SCALARS[value_type])
            if value_type == 8:
                return at + 8 + struct.unpack_from("<Q", m, at)[0]
            item_type, count = struct.unpack_from("<IQ", m, at)
            at += 12
            if item_type in _SCALARS:
                return at + count * struct.calcsize(_SCALARS[item_type])
            for _ in range(count):
                at = skip(item_type, at)
            return at

        for _ in range(num_kv):
            key, pos = string(pos)
            (value_type,) = struct.unpack_from("<I", m, pos)
            pos += 4
            if key in keys and value_type == 8:
                found[key], pos = string(pos)
            elif key in keys and value_type in _SCALARS:
                (found[key],) = struct.unpack_from("<" + _SCALARS[value_type], m, pos)
                pos = skip(value_type, pos)
            else:
                pos = skip(value_type, pos)
            if len(found) == len(keys) or found.get("general.architecture", "llama") != "llama":
                break
    return found


def _hf_config(reader, name: str):
    import transformers

    from executor_svc.models.hf_config import unsupported

    arch = _value(reader, "general.architecture")

    def key(suffix: str, default=None, required: bool = True):
        value = _value(reader, f"{arch}.{suffix}")
        if value is None and required and default is None:
            raise unsupported(f"{name}: GGUF metadata {arch}.{suffix} is missing")
        return default if value is None else value

    tensors = {t.name: t for t in reader.tensors}
    for refused in ("expert_shared_count", "expert_shared_feed_forward_length"):
        if key(refused, required=False):
            raise unsupported(f"{name}: {arch}.{refused}: shared experts are not supported")
    scaling = key("rope.scaling.type", required=False)
    if (scaling not in (None, "none")) or "rope_freqs.weight" in tensors:
        raise unsupported(f"{name}: {arch}.rope.scaling.type {scaling!r}: RoPE scaling is not supported in a MoE GGUF file")
    num_heads = key("attention.head_count")
    hidden_size = key("embedding_length")
    head_dim = key("attention.key_length", hidden_size // num_heads)
    if key("attention.value_length", head_dim) != head_dim or key("rope.dimension_count", head_dim) != head_dim:
        raise unsupported(f"{name}: {arch}: value_length and rope.dimension_count must equal key_length {head_dim}")
    bos, eos = _value(reader, "tokenizer.ggml.bos_token_id"), _value(reader, "tokenizer.ggml.eos_token_id")
    fields = dict(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF shapes are [in, out]
        hidden_size=hidden_size,
        num_hidden_layers=key("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=key("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        max_position_embeddings=key("context_length"),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))},
        num_experts_per_tok=key("expert_used_count"),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    if arch == "qwen3moe":
        num_experts_per_tok = fields["num_experts_per_tok"]
        ff = key("feed_forward_length", required=False)
        expert_ff = key("expert_feed_forward_length", required=False) or (ff // num_experts_per_tok if ff else None)
        if expert_ff is None:
            raise unsupported(f"{name}: GGUF metadata qwen3moe.expert_feed_forward_length is missing")
        return transformers.Qwen3MoeConfig(
            **fields, intermediate_size=ff or expert_ff, num_experts=key("expert_count"), moe_intermediate_size=expert_ff,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
        )
    return transformers.MixtralConfig(
        **fields, intermediate_size=key("feed_forward_length"), num_local_experts=key("expert_count"), sliding_window=None,
    )


def _value(reader, key: str):
    """A metadata value (a number or a string), None when the file has no such key."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()
