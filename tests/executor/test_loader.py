"""The safetensors loader: configs, sharded checkpoints, merged projections, refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from pagoda.model_files import fingerprint

from executor_svc.loader import (
    UnsupportedModelError,
    load_config,
    load_model,
    weight_files,
)


def test_default_model_config(default_model_dir):
    c = load_config(default_model_dir)
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "LlamaForCausalLM",
        30,
        576,
        9,
        3,
        64,
    )
    assert c.tie_word_embeddings and not c.qkv_bias and c.vocab_size == 49152
    assert c.eos_token_ids == (2,)


def test_configs_of_tiny_models(tiny_model_dirs):
    llama, qwen2, mistral = (load_config(tiny_model_dirs[k]) for k in ("llama", "qwen2", "mistral"))
    assert not llama.tie_word_embeddings and not llama.qkv_bias
    assert qwen2.tie_word_embeddings and qwen2.qkv_bias and not qwen2.o_bias
    assert mistral.head_dim == 32 and mistral.q_size == 128
    # llama3 scaling divides the low frequencies (long wavelengths) by the factor
    base = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert llama.inv_freq[0] == pytest.approx(base[0].item())
    assert llama.inv_freq[-1] == pytest.approx(base[-1].item() / 8)


def test_sharded_checkpoint_loads_every_tensor(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    files = weight_files(path)
    assert len(files) > 1 and (path / "model.safetensors.index.json").is_file()
    model = load_model(path, torch.device("cpu"), torch.float32)
    c = model.config
    tensors = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            tensors.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118
    layer = model.layers[1]
    q, _k, v = layer.self_attn.qkv_proj.weight.split((c.q_size, c.kv_size, c.kv_size))
    assert torch.equal(q, tensors["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(v, tensors["model.layers.1.self_attn.v_proj.weight"])
    _gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(up, tensors["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])


def test_bfloat16_load(tiny_model_dirs):
    model = load_model(tiny_model_dirs["qwen2"], torch.device("cpu"), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.rotary_cos.dtype == torch.float32


def test_missing_tensor_is_refused(tiny_model_dirs, tmp_path):
    src = tiny_model_dirs["qwen2"]
    shutil.copy(src / "config.json", tmp_path / "config.json")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.0.self_attn.k_proj.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="qkv_proj.bias"):
        load_model(tmp_path, torch.device("cpu"), torch.float32)


def test_unsupported_architecture_is_refused(tiny_model_dirs, tmp_path):
    config = json.loads((tiny_model_dirs["qwen2"] / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_config(tmp_path)


def test_fingerprint_tracks_config_and_weights(tiny_model_dirs):
    a, b = fingerprint(tiny_model_dirs["llama"]), fingerprint(tiny_model_dirs["qwen2"])
    assert a == fingerprint(tiny_model_dirs["llama"]) and a != b
