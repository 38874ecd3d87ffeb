"""kernels.fused_moe against a plain torch MoE, and `SparseMoE`'s kernel route against transformers.

Odd shapes: 1, 7 and 33 tokens; 4 and 8 experts; top 1 and 2; hidden 40 and intermediate 24
(not multiples of the 16-wide blocks); the last expert never routed to. fp32 within 1e-5;
fp16 and bf16 (gate_up and the activation rounded to the dtype between the launches, as the
kernel keeps them) within 1e-2 and 3e-2 of the fp32 reference on the same rounded inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.fused_moe as fused_moe_module
from kernels.fused_moe import fused_moe, moe_align_block_size

HIDDEN, INTERMEDIATE = 40, 24
BLOCKS = dict(block_m=16, block_n=16, block_k=16)
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def reference_moe(x, w_gate_up, w_down, topk_weights, topk_ids) -> torch.Tensor:
    """Each token through each of its experts, in float64, weighted and summed."""
    x, w_gate_up, w_down = x.double().cpu(), w_gate_up.double().cpu(), w_down.double().cpu()
    out = torch.zeros_like(x)
    for token, (weights, experts) in enumerate(zip(topk_weights.double().cpu(), topk_ids.cpu(), strict=True)):
        for weight, expert in zip(weights, experts.tolist(), strict=True):
            gate, up = (w_gate_up[expert] @ x[token]).chunk(2)
            out[token] += weight * (w_down[expert] @ (F.silu(gate) * up))
    return out


def routed(num_tokens: int, num_experts: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of a random router over all experts but the last (which gets no token), not
    renormalised (so a weight of top 1 is not 1 either)."""
    logits = torch.randn(num_tokens, num_experts, device=device)
    logits[:, -1] = -torch.inf
    return torch.topk(logits.softmax(-1), top_k, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_matches_reference(num_tokens, num_experts, top_k, dtype, device):
    x = torch.randn(num_tokens, HIDDEN, device=device).to(dtype)
    w_gate_up = (torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN, device=device) * HIDDEN**-0.5).to(dtype)
    w_down = (torch.randn(num_experts, HIDDEN, INTERMEDIATE, device=device) * INTERMEDIATE**-0.5).to(dtype)
    topk_weights, topk_ids = routed(num_tokens, num_experts, top_k, device)
    assert torch.bincount(topk_ids.flatten(), minlength=num_experts)[-1] == 0
    out = fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, **BLOCKS)
    assert out.dtype == dtype and out.shape == x.shape
    expected = reference_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCE[dtype])


def test_align_sorts_pairs_by_expert_and_pads_each_run_to_the_block():
    """The module docstring's picture: 3 tokens, top 2, 4 experts (expert 1 unrouted), blocks of 2."""
    sorted_pair_ids, block_expert_ids, num_padded = moe_align_block_size(torch.tensor([[2, 0], [0, 3], [2, 3]]), 4, 2)
    assert num_padded.tolist() == [6]
    assert sorted_pair_ids[:6].tolist() == [1, 2, 0, 4, 3, 5]
    assert (sorted_pair_ids[6:] == 6).all() and sorted_pair_ids.numel() == (6 + 4 * 1 + 1) // 2 * 2
    assert block_expert_ids[:3].tolist() == [0, 2, 3]


def test_align_pads_a_partial_block_with_the_sentinel():
    ids = torch.tensor([[1], [1], [1], [0]])
    sorted_pair_ids, block_expert_ids, num_padded = moe_align_block_size(ids, 2, 16)
    assert num_padded.item() == 32 and block_expert_ids[:2].tolist() == [0, 1]
    assert sorted_pair_ids[:16].tolist() == [3] + [4] * 15
    assert sorted_pair_ids[16:32].tolist() == [0, 1, 2] + [4] * 13


def test_default_blocks_give_the_same_result(device):
    x = torch.randn(9, HIDDEN, device=device)
    w_gate_up = torch.randn(4, 2 * INTERMEDIATE, HIDDEN, device=device) * 0.2
    w_down = torch.randn(4, HIDDEN, INTERMEDIATE, device=device) * 0.2
    topk_weights, topk_ids = routed(9, 4, 2, device)
    default = fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    small = fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, **BLOCKS)
    torch.testing.assert_close(default, small, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(activation="gelu_tanh"), "activation must be 'silu'"),
        (dict(w_down=torch.zeros(4, HIDDEN, INTERMEDIATE + 1)), "w_down must be \\[4, 40, 24\\]"),
        (dict(x=torch.zeros(3, HIDDEN, dtype=torch.float16)), "must share one of"),
        (dict(topk_ids=torch.zeros(3, 2)), "topk_ids must be integer"),
        (dict(topk_weights=torch.zeros(3, 1)), "topk_weights must be float \\(3, 2\\)"),
        (dict(block_m=24), "block_m must be a power of two >= 16"),
    ],
)
def test_refuses_bad_input_naming_it(change, message):
    args = dict(
        x=torch.zeros(3, HIDDEN),
        w_gate_up=torch.zeros(4, 2 * INTERMEDIATE, HIDDEN),
        w_down=torch.zeros(4, HIDDEN, INTERMEDIATE),
        topk_weights=torch.zeros(3, 2),
        topk_ids=torch.zeros(3, 2, dtype=torch.int64),
    )
    with pytest.raises(ValueError, match=message):
        fused_moe(**(args | change))


@pytest.fixture(scope="module")
def moe_family_dirs(tmp_path_factory):
    from pagoda.model_files import resolve_model
    from tests.model_families import build_family

    tokenizer_dir = resolve_model(None)
    return {kind: build_family(kind, tmp_path_factory.mktemp(kind), tokenizer_dir) for kind in ("qwen3_moe", "mixtral")}


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_sparse_moe_on_the_kernel_equals_transformers(kind, moe_family_dirs, device, monkeypatch):
    """A tiny Qwen3-MoE (top 2 not renormalised, a dense layer) and Mixtral (renormalised), float32,
    every `SparseMoE` forced onto the kernel (`fused=True`; on CPU tensors, the interpreter): a
    21-token prompt in chunks of 8 and 4 greedy tokens equal transformers', every row's
    log-probabilities within 1e-4."""
    from executor_svc.model_runner import ModelRunner
    from executor_svc.model import SparseMoE
    from pagoda.step import SamplingParams
    from scheduler_svc.core import Request
    from tests.executor.test_model_families import serve_recording_logits
    from tests.executor.test_model_runner import hf_greedy
    from tests.model_families import load_reference

    model_dir = moe_family_dirs[kind]
    runner = ModelRunner(model_dir, device=str(device), dtype="float32", block_size=4, num_kv_blocks=32)
    moes = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
    assert len(moes) == (3 if kind == "qwen3_moe" else 4)
    for moe in moes:
        moe.fused = True
    calls = []
    monkeypatch.setattr(fused_moe_module, "fused_moe", lambda *a, **k: calls.append(1) or fused_moe(*a, **k))
    prompt = torch.randint(3, 40000, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    request = Request("r", prompt, SamplingParams(temperature=0.0), max_tokens=4)
    rows = serve_recording_logits(runner, [request])
    assert len(calls) == len(moes) * 6  # 3 prefill chunks + 3 decodes, every sparse layer
    reference = load_reference(model_dir)
    assert request.output_token_ids == hf_greedy(reference, prompt, 4)
    tokens = prompt + request.output_token_ids
    with torch.no_grad():
        theirs = reference(torch.tensor([tokens[:-1]])).logits[0].log_softmax(-1)
    torch.testing.assert_close(torch.cat(rows["r"]).cpu().log_softmax(-1), theirs, atol=1e-4, rtol=1e-5)


def moe_config(hidden: int, num_experts: int, top_k: int, intermediate: int, norm_topk_prob: bool):
    from executor_svc.model import ModelConfig

    return ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=8, hidden_size=hidden, intermediate_size=4 * hidden,
        num_layers=1, num_heads=1, num_kv_heads=1, head_dim=hidden, rms_norm_eps=1e-6, max_position_embeddings=8,
        tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, inv_freq=(1.0,),
        rope_attention_scaling=1.0, sliding_window=None, eos_token_ids=(), num_experts=num_experts,
        num_experts_per_tok=top_k, moe_intermediate_size=intermediate, norm_topk_prob=norm_topk_prob,
    )


@pytest.mark.parametrize(
    ("shape", "token_counts", "fused"),
    [
        # on CPU (the interpreter) the kernel only when forced; on CUDA the default route
        ((HIDDEN, 8, 2, INTERMEDIATE, False), (1, 7, 33), True),
        # a Qwen3-30B-A3B-sized block: hidden 2048, 128 experts of 768, top 8
        pytest.param(
            (2048, 128, 8, 768, True), (1, 300), None,
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel is the default on CUDA only"),
        ),
    ],
    ids=["forced", "cuda-default"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_moe_kernel_route_matches_the_expert_loop(shape, token_counts, fused, dtype, device, monkeypatch):
    """`SparseMoE` on the kernel (`fused`) against the same weights on the expert loop (`fused=False`)."""
    from executor_svc.model import SparseMoE

    config = moe_config(*shape)
    moe = SparseMoE(config, dtype, fused=fused).to(device)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(std=config.hidden_size**-0.5)
    loop = SparseMoE(config, dtype, fused=False).to(device)
    loop.load_state_dict(moe.state_dict())
    calls = []
    monkeypatch.setattr(fused_moe_module, "fused_moe", lambda *a, **k: calls.append(1) or fused_moe(*a, **k))
    for num_tokens in token_counts:
        x = torch.randn(num_tokens, config.hidden_size, device=device).to(dtype)
        with torch.no_grad():
            torch.testing.assert_close(moe(x).float(), loop(x).float(), **TOLERANCE[dtype])
    assert len(calls) == len(token_counts)
