"""Shared fixtures for executor tests: the default model, its transformers reference, tiny random models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_VOCAB = 1024


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """The executor tests run on one thread: on a shared 2-core machine, two OpenMP threads
    wait on each other whenever another process holds a core (several times slower)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="package", autouse=True)
def executor_link_secret():
    """The per-user secret of the executor link, as a scheduler's first start makes it: the executor
    processes these tests start read it before anything else (without it they wait for a scheduler
    to make it, and a test run of this folder alone on a fresh machine timed out)."""
    from pagoda.link_security import ensure_default_secret

    return ensure_default_secret()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pagoda.model_files import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def hf_default(default_model_dir):
    """transformers' reference for the default model, fp32, loaded once."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_runner(default_model_dir):
    """One ModelRunner on the default model for the session; tests use distinct request ids."""
    from executor_svc.model_runner import ModelRunner

    return ModelRunner(default_model_dir, device="cpu", block_size=16, num_kv_blocks=256)


def _tiny_config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = {
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "initializer_range": 0.1,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if kind == "llama":  # llama3 RoPE scaling, untied LM head, saved in shards
        return LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if kind == "qwen2":  # q/k/v bias, tied embeddings
        return Qwen2Config(
            **common, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        )
    if kind == "mistral":  # head_dim (32) != hidden / heads (16)
        return MistralConfig(**common, head_dim=32, tie_word_embeddings=False)
    raise ValueError(kind)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Random tiny Llama / Qwen2 / Mistral checkpoints saved with save_pretrained (safetensors)."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for i, kind in enumerate(("llama", "qwen2", "mistral")):
        torch.manual_seed(1234 + i)
        model = AutoModelForCausalLM.from_config(_tiny_config(kind), dtype=torch.float32)
        if kind == "qwen2":  # transformers initialises biases at zero: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.5)
        path = tmp_path_factory.mktemp(f"tiny-{kind}")
        model.save_pretrained(path, max_shard_size="100KB" if kind == "llama" else "1GB")
        dirs[kind] = path
    return dirs


@pytest.fixture(scope="session")
def windowed_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Random tiny models with sliding windows: a Mistral whose every layer attends within 32
    tokens, and a Qwen2 with a full-attention layer 0 and layers 1-2 within 24 tokens."""
    from transformers import AutoModelForCausalLM

    mistral = _tiny_config("mistral")
    mistral.sliding_window = 32
    qwen2 = _tiny_config("qwen2")
    qwen2.num_hidden_layers = 3
    qwen2.use_sliding_window, qwen2.max_window_layers, qwen2.sliding_window = True, 1, 24
    qwen2.layer_types = ["full_attention", "sliding_attention", "sliding_attention"]
    dirs = {}
    for i, (kind, config) in enumerate((("mistral", mistral), ("qwen2", qwen2))):
        torch.manual_seed(4321 + i)
        dirs[kind] = tmp_path_factory.mktemp(f"tiny-{kind}-windowed")
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(dirs[kind])
    return dirs
