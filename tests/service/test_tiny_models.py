"""Random tiny Llama / Qwen2 models saved as Hugging Face directories, served end to end."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from tests.service.harness import hf_greedy, Service, collect, greedy_request

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny(kind: str, out_dir, default_model_dir, shard: bool):
    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,
    )
    config = LlamaConfig(**common, tie_word_embeddings=False) if kind == "llama" else Qwen2Config(**common, tie_word_embeddings=True)
    torch.manual_seed(0 if kind == "llama" else 1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # Qwen2's q/k/v biases start at zero: make them count
                param.normal_(0.0, 0.5)
    model.save_pretrained(out_dir, max_shard_size="2MB" if shard else "5GB")
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, out_dir / name)
    return AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_model_greedy_equals_transformers(kind, tmp_path, default_model_dir):
    reference = build_tiny(kind, tmp_path, default_model_dir, shard=(kind == "llama"))
    if kind == "llama":
        assert len(list(tmp_path.glob("*.safetensors"))) > 1  # sharded checkpoint
    else:
        assert reference.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    prompts = [[1, 520 + i * 7, 33, 1200 + i, 9, 17 + i] * (1 + i) for i in range(5)]
    with Service(model=str(tmp_path), scheduler_args=["--max-num-batched-tokens", "32"]) as svc:
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(lambda p: collect(svc.stub.Generate(greedy_request(prompt_ids=p, max_tokens=20, ignore_eos=True), timeout=300)), prompts)
            )
        for prompt, result in zip(prompts, results):
            assert result["outputs"][0]["token_ids"] == hf_greedy(reference, prompt, 20, ignore_eos=True)
        info = svc.wait_all_blocks_free()
        assert all(e.num_free_blocks == e.num_total_blocks for e in info.executors)


@pytest.fixture(scope="module")
def family_references(tmp_path_factory, default_model_dir):
    """Each family's tiny folder and transformers' greedy tokens for its prompts, before any service starts."""
    from tests.model_families import WINDOW, build_family, load_reference

    prompts = [[1, 520 + i * 7, 33, 1200 + i, 9, 17 + i, 4000 + 3 * i] * (2 + 3 * i) for i in range(3)]
    assert max(map(len, prompts)) > 3 * WINDOW
    references = {}
    for kind in SERVED_FAMILIES:
        path = build_family(kind, tmp_path_factory.mktemp(f"served-{kind}"), default_model_dir)
        reference = load_reference(path)
        references[kind] = path, [(p, hf_greedy(reference, p, 20, ignore_eos=True)) for p in prompts]
    return references


# llama and qwen2 are served above; these once each, through the real scheduler and executor
SERVED_FAMILIES = ("mistral", "qwen3", "qwen3_moe", "mixtral", "phi3", "gemma2", "gemma3")


@pytest.mark.parametrize("kind", SERVED_FAMILIES)
def test_family_served_equals_transformers(kind, family_references):
    """Three prompts of up to 4 windows at once, in chunks of 16 tokens: transformers' greedy tokens."""
    path, expected = family_references[kind]
    with Service(model=str(path), scheduler_args=["--max-num-batched-tokens", "16"]) as svc:
        with ThreadPoolExecutor(len(expected)) as pool:
            results = list(
                pool.map(
                    lambda item: collect(svc.stub.Generate(greedy_request(prompt_ids=item[0], max_tokens=20, ignore_eos=True), timeout=300)),
                    expected,
                )
            )
        for (_prompt, tokens), result in zip(expected, results):
            assert result["outputs"][0]["token_ids"] == tokens
        info = svc.wait_all_blocks_free()
        assert all(e.num_free_blocks == e.num_total_blocks for e in info.executors)
