"""The executor with an fp8 (e4m3) KV cache through the triton backend: half the bytes of
bf16 per block, logits close to the full-precision cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from executor_svc.model_runner import ModelRunner
from pagoda.step import NewRequestData, SamplingParams, StepPlan


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
    )
    torch.manual_seed(7)
    path = tmp_path_factory.mktemp("tiny-llama-fp8")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def _prefill_then_decode_logits(runner: ModelRunner) -> torch.Tensor:
    prompt = [(i * 37 + 11) % 500 + 3 for i in range(40)]
    greedy = SamplingParams(temperature=0.0)
    first = StepPlan(0, [NewRequestData("r", prompt, len(prompt), greedy, [3, 7, 5], 0)], [], {"r": len(prompt)})
    _, logits = runner.execute_with_logits(first)
    # The decode step reads the whole prompt back from the (quantized) cache.
    second = StepPlan(1, [], [], {"r": 1})
    _, more = runner.execute_with_logits(second)
    return torch.cat([logits["r"], more["r"]])


@pytest.mark.slow  # a model runner, ~50 s on 2 shared cores
def test_fp8_cache_halves_memory_and_keeps_logits_close(tiny_llama):
    exact = ModelRunner(tiny_llama, device="cpu", num_kv_blocks=16, attention_backend="torch")
    triton_fp32 = ModelRunner(tiny_llama, device="cpu", num_kv_blocks=16, attention_backend="triton")
    fp8 = ModelRunner(tiny_llama, device="cpu", num_kv_blocks=16, attention_backend="triton", kv_cache_dtype="fp8")
    assert fp8.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert fp8.kv_block_bytes * 4 == exact.kv_block_bytes  # fp32 -> fp8; bf16 -> fp8 halves it
    reference = _prefill_then_decode_logits(exact)
    quantized = _prefill_then_decode_logits(fp8)
    assert torch.allclose(_prefill_then_decode_logits(triton_fp32), reference, atol=1e-4, rtol=1e-4)
    # Attention reads K/V back from the fp8 cache: the same as exact attention over K/V rounded to e4m3.
    emulated = ModelRunner(tiny_llama, device="cpu", num_kv_blocks=16, attention_backend="torch")
    emulated.attention = _RoundKVToFp8(emulated.attention)
    expected = _prefill_then_decode_logits(emulated)
    assert (quantized - reference).abs().max().item() > 1e-3  # the cache really is quantized
    assert torch.allclose(quantized, expected, atol=1e-4, rtol=1e-4)


class _RoundKVToFp8:
    """Wraps the torch backend: K and V pass through float8_e4m3fn before they are cached."""

    def __init__(self, inner):
        self.inner, self.name = inner, "fp8-emulated"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        k = k.to(torch.float8_e4m3fn).to(k.dtype)
        v = v.to(torch.float8_e4m3fn).to(v.dtype)
        return self.inner.forward(q, k, v, k_cache, v_cache, meta, scale)

    def copy_blocks(self, caches, src_dst):
        self.inner.copy_blocks(caches, src_dst)


def test_fp8_needs_the_triton_backend(tiny_llama):
    with pytest.raises(ValueError, match="triton"):
        ModelRunner(tiny_llama, device="cpu", num_kv_blocks=16, attention_backend="torch", kv_cache_dtype="fp8")


def test_executor_refuses_e4m3_at_start_on_an_a100(monkeypatch, capsys):
    """Asked for fp8_e4m3 on a GPU before sm_89, the executor stops at start naming the flag and the GPU."""
    from executor_svc.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert main(["--kv-cache-dtype", "fp8_e4m3", "--scheduler", "tcp://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "error: --kv-cache-dtype fp8_e4m3: NVIDIA A100-SXM4-80GB has compute capability 8.0" in err
    assert "use --kv-cache-dtype fp8_e5m2" in err
