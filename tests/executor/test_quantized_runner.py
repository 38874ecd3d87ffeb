"""Quantized weights on the default model: GGUF blocks kept (identity with transformers), int8 (quality bound)."""

from __future__ import annotations

import math

import pytest
import torch

from executor_svc.loader import load_model
from executor_svc.model_runner import ModelRunner
from executor_svc.quant.gguf_kernel import get_kernel
from executor_svc.quant.gguf_linear import GGUFLinear
from pagoda import model_files
from tests.executor.plans import PlanBuilder, run_to_completion
from tests.executor.test_model_runner import assert_same_greedy, hf_greedy, mixed_workload

pytestmark = pytest.mark.skipif(get_kernel() is None, reason="no C compiler: the GGUF kernel is not built")

# A fixed text for perplexity (not from the model's training data as far as we know; plain prose).
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small tin of oil "
    "and a cloth to polish the great lens. For thirty years he had watched the ships pass along the rocky "
    "coast, and in all that time not one had been lost on his stretch of water. The villagers said he "
    "never slept, but the truth was simpler: he loved the quiet hours before dawn, when the sea was calm "
    "and the gulls had not yet begun to cry."
)


@pytest.fixture(scope="module")
def gguf_dir():
    return model_files.resolve_model(None, weights=False)


@pytest.fixture(scope="module")
def quantized_runner(gguf_dir):
    return ModelRunner(gguf_dir, device="cpu", block_size=16, num_kv_blocks=256)


@pytest.fixture(scope="module")
def prompts(gguf_dir) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_dir))
    texts = [
        "The capital of France is",
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
        "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    ]
    return {f"q{i}": tok(t)["input_ids"] for i, t in enumerate(texts)}


def test_gguf_blocks_are_kept_by_default(quantized_runner):
    assert quantized_runner.quantization == "gguf"
    layer = quantized_runner.model.layers[0]
    assert all(isinstance(m, GGUFLinear) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert layer.self_attn.qkv_proj.types == [3]  # Q4_1, q/k/v in one segment
    assert quantized_runner.model.lm_head.types == [8]  # the tied head is the Q8_0 embedding's blocks
    # 98 MB file -> ~94 MiB resident (+ float32 norms and rotary tables), where float32 takes 515 MiB
    assert 85 * 2**20 < quantized_runner.weight_bytes < 100 * 2**20


def test_kept_blocks_greedy_and_logprobs_match_transformers(quantized_runner, hf_default, prompts):
    builder = PlanBuilder(block_size=16, num_blocks=quantized_runner.num_kv_blocks, seed=4)
    mixed_workload(builder, prompts, max_tokens=24)  # uneven prefill chunks beside decodes: both matmul paths
    rows: dict[str, list[torch.Tensor]] = {r: [] for r in prompts}

    def step(plan):
        result, logits = quantized_runner.execute_with_logits(plan)
        for req_id, lg in logits.items():
            rows[req_id].append(lg)
        return result

    outputs = run_to_completion(quantized_runner, builder, on_step=step)
    for req_id, prompt in prompts.items():
        assert_same_greedy(outputs[req_id], hf_greedy(hf_default, prompt, 24))
        tokens = prompt + outputs[req_id]
        with torch.no_grad():
            theirs = hf_default(torch.tensor([tokens[:-1]])).logits[0].log_softmax(-1)
        ours = torch.cat(rows[req_id]).log_softmax(-1)
        likely = theirs > -10  # the same float32 numbers up to summation order
        torch.testing.assert_close(ours[likely], theirs[likely], atol=2e-4, rtol=0)


def test_quantization_none_dequantizes_as_transformers(gguf_dir, default_model_dir):
    """The GGUF file read and dequantized by us equals transformers' float32 conversion, tensor for tensor."""
    ours = load_model(gguf_dir, torch.device("cpu"), torch.float32, "none")
    theirs = load_model(default_model_dir, torch.device("cpu"), torch.float32, "none")
    a, b = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _teacher_forced_logprobs(runner: ModelRunner, tokens: list[int], chunk_sizes: list[int] | None = None) -> torch.Tensor:
    builder = PlanBuilder(block_size=runner.block_size, num_blocks=runner.num_kv_blocks, seed=5)
    builder.add("ppl", tokens, max_tokens=1, chunk_sizes=chunk_sizes or [37, 5, len(tokens)])
    rows: list[torch.Tensor] = []

    def step(plan):
        result, logits = runner.execute_with_logits(plan)
        rows.extend(logits.values())
        return result

    run_to_completion(runner, builder, on_step=step)
    return torch.cat(rows)[:-1].log_softmax(-1)


def test_int8_quality_bound(default_model_dir, hf_default, prompts):
    """int8 per-channel weights: perplexity within 2 % of float32's and teacher-forced top-1 agreement >= 90 %.

    Measured (weights-only int8, float32 activations): perplexity 33.29 vs 33.51, agreement 94.6 %; greedy
    runs equal transformers' for the first tokens of every prompt (a near-tie later may fork).
    """
    runner = ModelRunner(default_model_dir, device="cpu", block_size=16, num_kv_blocks=64, quantization="int8")
    assert runner.quantization == "int8"
    assert isinstance(runner.model.layers[0].mlp.gate_up_proj, GGUFLinear) and runner.weight_bytes < 250 * 2**20
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(str(default_model_dir))(TEXT)["input_ids"]
    ours = _teacher_forced_logprobs(runner, tokens)
    with torch.no_grad():
        theirs = hf_default(torch.tensor([tokens])).logits[0, :-1].log_softmax(-1)
    target = torch.tensor(tokens[1:])
    nll = lambda lp: -lp.gather(1, target[:, None]).mean().item()  # noqa: E731
    ppl_ours, ppl_theirs = math.exp(nll(ours)), math.exp(nll(theirs))
    agreement = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    print(f"int8: perplexity {ppl_ours:.3f} vs float32 {ppl_theirs:.3f}, top-1 agreement {agreement:.3f}")
    assert abs(ppl_ours / ppl_theirs - 1) < 0.02, (ppl_ours, ppl_theirs)
    assert agreement >= 0.90, agreement
    builder = PlanBuilder(block_size=16, num_blocks=64, seed=6)
    for req_id, prompt in prompts.items():
        builder.add(req_id, prompt, 4)
    outputs = run_to_completion(runner, builder)
    for req_id, prompt in prompts.items():
        assert outputs[req_id][:4] == hf_greedy(hf_default, prompt, 4)[:4]


def test_no_kernel_falls_back_to_float32(gguf_dir, monkeypatch):
    """Without the kernel (no compiler, or switched off) a GGUF model is dequantized at load and still serves."""
    from executor_svc.quant import gguf_kernel

    monkeypatch.setattr(gguf_kernel, "_kernel", None)
    runner = ModelRunner(gguf_dir, device="cpu", block_size=16, num_kv_blocks=16)
    assert runner.quantization == "none" and runner.weight_bytes > 400 * 2**20
    assert not any(isinstance(m, GGUFLinear) for m in runner.model.modules())
