"""ModelRunner against Hugging Face transformers on the same weights: tokens and log-probabilities."""

from __future__ import annotations

import pytest
import torch

from executor_svc.model_runner import ModelRunner, PlanError
from pagoda.step import BlockCopy, NewRequestData, SamplingParams, StepPlan
from tests.executor.plans import PlanBuilder, run_to_completion

GREEDY = SamplingParams(temperature=0.0)


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate (stops early at EOS)."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def assert_same_greedy(ours: list[int], theirs: list[int]) -> None:
    # transformers stops at EOS; the plan builder always runs max_tokens.
    assert ours[: len(theirs)] == theirs


def mixed_workload(builder: PlanBuilder, prompts: dict[str, list[int]], max_tokens: int) -> None:
    """Prefills chunked into uneven pieces, admitted at different steps, beside other requests' decodes."""
    chunks = [[7, 1, 16, 3], [33], [5, 17, 9]]
    for i, (req_id, prompt) in enumerate(prompts.items()):
        builder.add(req_id, prompt, max_tokens, GREEDY, chunk_sizes=chunks[i % 3], start_step=3 * i)


@pytest.fixture(scope="module")
def default_prompts(default_model_dir) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    texts = [
        "The capital of France is",
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
        "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    ]
    return {f"p{i}": tok(t)["input_ids"] for i, t in enumerate(texts)}


def test_default_model_greedy_matches_transformers(default_runner, hf_default, default_prompts):
    builder = PlanBuilder(block_size=default_runner.block_size, num_blocks=default_runner.num_kv_blocks, seed=1)
    mixed_workload(builder, default_prompts, max_tokens=20)
    outputs = run_to_completion(default_runner, builder)
    for req_id, prompt in default_prompts.items():
        assert_same_greedy(outputs[req_id], hf_greedy(hf_default, prompt, 20))
    assert not default_runner.requests


def test_default_model_logprobs_match_transformers(default_runner, hf_default, default_prompts):
    """log_softmax of every computed row (prompt chunks and decodes) within 1e-4 of transformers.

    Plus 1e-5 relative: with oneDNN-packed weights (the CPU default) fp32 accumulation order
    moves the log-probabilities of the least likely tokens (below -10) by up to ~1.1e-4.
    """
    builder = PlanBuilder(block_size=16, num_blocks=default_runner.num_kv_blocks, seed=2)
    mixed_workload(builder, default_prompts, max_tokens=4)
    rows: dict[str, list[torch.Tensor]] = {r: [] for r in default_prompts}

    def step(plan):
        result, logits = default_runner.execute_with_logits(plan)
        for req_id, lg in logits.items():
            rows[req_id].append(lg)
        return result

    outputs = run_to_completion(default_runner, builder, on_step=step)
    for req_id, prompt in default_prompts.items():
        tokens = prompt + outputs[req_id]
        ours = torch.cat(rows[req_id]).log_softmax(-1)
        with torch.no_grad():
            theirs = hf_default(torch.tensor([tokens[:-1]])).logits[0].float().log_softmax(-1)
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-5)
        likely = theirs > -10
        torch.testing.assert_close(ours[likely], theirs[likely], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_tiny_models_greedy_match_transformers(tiny_model_dirs, kind):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dirs[kind]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    runner = ModelRunner(model_dir, block_size=16, num_kv_blocks=64)
    g = torch.Generator().manual_seed(7)
    prompts = {f"{kind}{i}": torch.randint(3, 1000, (n,), generator=g).tolist() for i, n in enumerate((5, 37, 70))}
    builder = PlanBuilder(block_size=16, num_blocks=64, seed=3)
    mixed_workload(builder, prompts, max_tokens=24)
    rows: dict[str, list[torch.Tensor]] = {r: [] for r in prompts}

    def step(plan):
        result, logits = runner.execute_with_logits(plan)
        for req_id, lg in logits.items():
            rows[req_id].append(lg)
        return result

    outputs = run_to_completion(runner, builder, on_step=step)
    for req_id, prompt in prompts.items():
        assert_same_greedy(outputs[req_id], hf_greedy(hf, prompt, 24))
        with torch.no_grad():
            theirs = hf(torch.tensor([(prompt + outputs[req_id])[:-1]])).logits[0].log_softmax(-1)
        torch.testing.assert_close(torch.cat(rows[req_id]).log_softmax(-1), theirs, atol=1e-4, rtol=0)


def test_sharded_checkpoint_is_sharded(tiny_model_dirs):
    assert (tiny_model_dirs["llama"] / "model.safetensors.index.json").is_file()
    assert len(list(tiny_model_dirs["llama"].glob("*.safetensors"))) > 1


def test_preempted_request_resumes_with_the_same_tokens(tiny_model_dirs):
    """Dropped mid-generation and re-added as new (recompute): the continuation is unchanged."""
    runner = ModelRunner(tiny_model_dirs["qwen2"], num_kv_blocks=64)
    prompt = list(range(10, 50))
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=42)
    reference = PlanBuilder(num_blocks=64, seed=4)
    reference.add("a", prompt, 16, seeded)
    reference.add("b", prompt, 16, GREEDY)
    expected = run_to_completion(runner, reference)

    builder = PlanBuilder(num_blocks=64, seed=5)
    builder.add("a", prompt, 16, seeded, chunk_sizes=[13])
    builder.add("b", prompt, 16, GREEDY)
    for _ in range(8):
        builder.update(plan := builder.next_plan(), runner.execute(plan))
    builder.preempt("a")
    builder.preempt("b")
    assert run_to_completion(runner, builder) == expected


def test_block_copies_and_sampled_rows(default_runner):
    """A plan may copy blocks; only requests whose scheduled tokens reach their end are sampled."""
    k0, v0 = default_runner.kv_caches[0]
    k0[3].normal_()
    v0[3].normal_()
    plan = StepPlan(
        step_id=0,
        new_requests=[
            NewRequestData("cp-a", list(range(40, 60)), 20, GREEDY, [11, 12], 0),
            NewRequestData("cp-b", list(range(40, 60)), 20, GREEDY, [13, 14], 0),
        ],
        num_scheduled_tokens={"cp-a": 20, "cp-b": 7},
        block_copies=[BlockCopy(src=3, dst=5)],
    )
    result = default_runner.execute(plan)
    assert [s.req_id for s in result.sampled] == ["cp-a"]
    assert default_runner.requests["cp-b"].num_computed_tokens == 7
    for k, v in default_runner.kv_caches:
        assert torch.equal(k[5], k[3]) and torch.equal(v[5], v[3])
    default_runner.execute(StepPlan(step_id=1, finished_req_ids=["cp-a", "cp-b"]))
    assert not default_runner.requests


def test_plan_errors_name_the_request(default_runner):
    with pytest.raises(PlanError, match="ghost"):
        default_runner.execute(StepPlan(step_id=0, num_scheduled_tokens={"ghost": 1}))
    plan = StepPlan(
        step_id=1,
        new_requests=[NewRequestData("short", list(range(40)), 40, GREEDY, [7], 0)],
        num_scheduled_tokens={"short": 40},
    )
    with pytest.raises(PlanError, match="short"):
        default_runner.execute(plan)
    default_runner.reset()
    assert not default_runner.requests


def test_properties(default_runner, default_model_dir):
    assert default_runner.device == "cpu"
    assert default_runner.block_size == 16
    assert default_runner.num_kv_blocks == 256
    assert default_runner.vocab_size == 49152
    assert default_runner.max_model_len == 8192
    assert len(default_runner.fingerprint) == 16
    assert default_runner.kv_caches[0][0].shape == (256, 16, 3, 64)
    from pagoda.model_files import fingerprint

    assert fingerprint(default_model_dir) == default_runner.fingerprint


def test_seeded_request_ignores_its_batch_and_reports_logprobs(tiny_model_dirs):
    runner = ModelRunner(tiny_model_dirs["llama"], num_kv_blocks=64)
    prompt = list(range(100, 130))
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=7, logprobs=True, top_logprobs=3)
    alone = PlanBuilder(num_blocks=64, seed=6)
    alone.add("s", prompt, 12, seeded)
    expected = run_to_completion(runner, alone)["s"]

    crowd = PlanBuilder(num_blocks=64, seed=7)
    crowd.add("x", list(range(5, 60)), 12, SamplingParams(temperature=1.2), chunk_sizes=[9])
    crowd.add("s", prompt, 12, seeded, chunk_sizes=[11, 4], start_step=1)
    crowd.add("y", list(range(300, 310)), 12, SamplingParams(temperature=0.7, seed=3))

    def step(plan):
        result, logits = runner.execute_with_logits(plan)
        for token in result.sampled:
            if token.req_id == "s":
                raw = logits["s"][-1].log_softmax(-1)
                assert token.logprob == pytest.approx(raw[token.token_id].item(), abs=1e-5)
                assert [t for t, _ in token.top_logprobs] == raw.topk(3).indices.tolist()
        return result

    assert run_to_completion(runner, crowd, on_step=step)["s"] == expected


def test_dummy_prefill_used_for_memory_profiling(tiny_model_dirs):
    runner = ModelRunner(tiny_model_dirs["mistral"], num_kv_blocks=8, kv_memory_bytes=None)
    probs = runner.run_dummy_prefill(100, num_logits_rows=7)
    assert probs.shape == (7, runner.vocab_size)
    torch.testing.assert_close(probs.sum(-1), torch.ones(7))


def test_kv_cache_sized_from_a_memory_budget(tiny_model_dirs):
    runner = ModelRunner(tiny_model_dirs["qwen2"], kv_memory_bytes=1 << 20)
    # 2 (K, V) x 2 layers x 16 tokens x 2 KV heads x 16 dims x 4 bytes = 8 KiB per block
    assert runner.kv_block_bytes == 8192
    assert runner.num_kv_blocks == (1 << 20) // 8192
