"""Speculative decoding on the executor: the acceptance rule, and the real model driven by the real core.

The acceptance rule is checked against the target distribution by counting (total
variation, fixed seeds, enough draws that a wrong rule fails, which the test shows on
two wrong rules). Greedy decoding with drafts, through `Scheduler` + `ModelRunner` in
one process, must equal transformers' greedy output token for token (logprobs within
tolerance), under chunked prefill and preemption, with drafts mostly accepted and
mostly rejected.
"""

from __future__ import annotations

import pytest
import torch

from executor_svc.spec_decode import greedy_accept, rejection_sample
from pagoda.step import SamplingParams
from scheduler_svc.core import Request, Scheduler, SchedulerConfig, SpeculativeConfig
from tests.service.harness import hf_greedy

NUM_DRAWS = 20_000


def _total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def _empirical(rule, probs: torch.Tensor, drafts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first token, and of the second given that the first draft was accepted."""
    vocab = probs.shape[1]
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for i in range(NUM_DRAWS):
        generator = torch.Generator().manual_seed(i)
        tokens = rule(probs, drafts, [generator] * probs.shape[0])
        first[tokens[0]] += 1
        if tokens[0] == drafts[0] and len(tokens) > 1:  # accepted (a wrong rule may redraw it)
            second[tokens[1]] += 1
    return first, second


def _accept_always_on_residual_from_p(probs, drafts, generators):
    """A wrong rule: on rejection, draw from p itself instead of the residual."""
    for j, draft in enumerate(drafts):
        if torch.rand((), generator=generators[j]) >= probs[j, draft]:
            return drafts[:j] + [int(torch.multinomial(probs[j], 1, generator=generators[j]))]
    return drafts + [int(torch.multinomial(probs[len(drafts)], 1, generator=generators[0]))]


def _accept_with_half_probability(probs, drafts, generators):
    """A wrong rule: a fixed acceptance rate, whatever the target thinks of the draft."""
    for j, draft in enumerate(drafts):
        if torch.rand((), generator=generators[j]) >= 0.5:
            residual = probs[j].clone()
            residual[draft] = 0
            return drafts[:j] + [int(torch.multinomial(residual, 1, generator=generators[j]))]
    return drafts + [int(torch.multinomial(probs[len(drafts)], 1, generator=generators[0]))]


def test_rejection_sampling_keeps_the_target_distribution():
    probs = torch.tensor(
        [
            [0.10, 0.40, 0.05, 0.25, 0.20],  # the draft 1 is likely
            [0.50, 0.02, 0.08, 0.10, 0.30],  # the draft 1 is unlikely
            [0.20, 0.20, 0.20, 0.20, 0.20],
        ]
    )
    drafts = [1, 1]
    first, second = _empirical(rejection_sample, probs, drafts)
    assert _total_variation(first, probs[0]) < 0.02
    assert _total_variation(second, probs[1]) < 0.03  # ~8,000 draws
    # the same test fails wrong rules
    for wrong in (_accept_always_on_residual_from_p, _accept_with_half_probability):
        first, _ = _empirical(wrong, probs, drafts)
        assert _total_variation(first, probs[0]) > 0.05, wrong.__name__


def test_a_certain_draft_is_always_accepted_and_the_bonus_token_is_drawn():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert rejection_sample(probs, [1, 2], [None, None, None]) == [1, 2, 0]
    assert rejection_sample(probs, [0, 2], [None, None, None]) == [1]


def test_greedy_accepts_while_the_draft_is_the_argmax():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert greedy_accept([4], []) == [4]


# ---- the real model through the real core -----------------------------------------------


def _run(runner, requests: list[Request], config: SchedulerConfig, updates: list | None = None) -> Scheduler:
    scheduler = Scheduler(config)
    for request in requests:
        scheduler.add_requests([request])
    for _ in range(2_000):
        if not scheduler.has_unfinished():
            break
        plan = scheduler.schedule()
        step_updates = scheduler.update_from_output(plan, runner.execute(plan))
        if updates is not None:
            updates += step_updates
        scheduler.check_integrity()
    runner.execute(scheduler.schedule())  # drop the finished requests' state
    assert not scheduler.has_unfinished()
    stats = scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return scheduler


@pytest.fixture(scope="module")
def spec_prompts(default_runner):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_runner.model_dir))
    paragraph = "The quick brown fox jumps over the lazy dog. The dog sleeps in the warm sun all day long."
    texts = [
        f"Repeat this text exactly: {paragraph}\nRepeated: {paragraph[:20]}",  # drafts mostly accepted
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\ndef fib",
        "Name three colours and explain why the sky looks blue to us.",  # drafts mostly rejected
    ]
    return [tokenizer(text)["input_ids"] for text in texts]


@pytest.mark.parametrize("setting", ["roomy", "chunked_prefill_and_preemption"])
def test_greedy_with_drafts_equals_transformers(default_runner, hf_default, spec_prompts, setting):
    max_tokens = 24
    config = SchedulerConfig(
        num_blocks=default_runner.num_kv_blocks if setting == "roomy" else 9,
        block_size=16,
        max_num_batched_tokens=512 if setting == "roomy" else 24,
        speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4),
    )
    greedy = SamplingParams(temperature=0.0, logprobs=True)
    requests = [
        Request(f"spec-{setting}-{i}", prompt, greedy, max_tokens=max_tokens, arrival_time=i) for i, prompt in enumerate(spec_prompts)
    ]
    updates: list = []
    scheduler = _run(default_runner, requests, config, updates)
    for request, prompt in zip(requests, spec_prompts):
        assert request.output_token_ids == hf_greedy(hf_default, prompt, max_tokens, ignore_eos=True), request.req_id
        # the logprob of each token, accepted draft or not, is the target model's
        with torch.inference_mode():
            logits = hf_default(torch.tensor([prompt + request.output_token_ids])).logits[0, len(prompt) - 1 : -1]
        expected = logits.log_softmax(-1).gather(1, torch.tensor(request.output_token_ids)[:, None])[:, 0]
        got = torch.tensor([u.sampled.logprob for u in updates if u.req_id == request.req_id])
        assert torch.allclose(got, expected, atol=2e-3), (got - expected).abs().max()
    assert requests[0].num_accepted_draft_tokens >= max_tokens // 4  # the repeated text is drafted
    assert requests[0].num_draft_tokens > requests[0].num_accepted_draft_tokens or requests[2].num_draft_tokens
    if setting != "roomy":
        assert scheduler.num_preemptions > 0


def test_seeded_sampling_with_drafts_is_reproducible_with_logprobs(default_runner, spec_prompts):
    config = SchedulerConfig(
        num_blocks=default_runner.num_kv_blocks,
        speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4),
    )
    outputs = []
    for attempt in range(2):
        sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7, logprobs=True)
        request = Request(f"seeded-{attempt}", spec_prompts[0], sampling, max_tokens=20)
        others = [Request(f"other-{attempt}-{i}", spec_prompts[1], SamplingParams(), max_tokens=5 + attempt * 7) for i in range(attempt + 1)]
        _run(default_runner, [request, *others], config)
        outputs.append(request.output_token_ids)
        assert request.num_accepted_draft_tokens > 0
    assert outputs[0] == outputs[1]


def test_sampled_tokens_with_drafts_follow_the_model_distribution(tiny_model_dirs):
    """Through the real ModelRunner: tokens after a verified draft are distributed as the
    model's (transformers' logits, top_k 5), for the first token and, once the first draft
    is accepted, for the second; 3,000 seeded requests."""
    from transformers import AutoModelForCausalLM

    from executor_svc.model_runner import ModelRunner
    from executor_svc.sampler import filter_logits
    from pagoda.step import CachedRequestData, NewRequestData, StepPlan

    top_k, num_requests, batch = 5, 3_000, 1_000
    prompt = [(37 * i + 11) % 1000 + 3 for i in range(20)]
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32).eval()

    def target(tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = reference(torch.tensor([tokens])).logits[0, -1:]
        return torch.softmax(filter_logits(logits, top_k=[top_k], top_p=[1.0], min_p=[0.0]), dim=-1)[0]

    p0 = target(prompt)
    d0 = int(p0.topk(2).indices[1])  # a plausible draft, not the likeliest token
    p1 = target(prompt + [d0])
    drafts = [d0, int(p1.argmax())]
    runner = ModelRunner(tiny_model_dirs["llama"], num_kv_blocks=2 * batch + 1)
    first, second = torch.zeros(p0.shape[0]), torch.zeros(p0.shape[0])
    for start in range(0, num_requests, batch):
        ids = [f"d{i}" for i in range(start, start + batch)]
        new = [
            NewRequestData(req_id, list(prompt), len(prompt), SamplingParams(top_k=top_k, seed=i), [2 * j + 1, 2 * j + 2], 0)
            for j, (i, req_id) in enumerate(zip(range(start, start + batch), ids))
        ]
        runner.execute(StepPlan(step_id=0, new_requests=new, num_scheduled_tokens={r: len(prompt) - 1 for r in ids}))
        result = runner.execute(
            StepPlan(
                step_id=1,
                cached_requests=[CachedRequestData(r, []) for r in ids],
                num_scheduled_tokens={r: 1 + len(drafts) for r in ids},
                scheduled_spec_decode_tokens={r: list(drafts) for r in ids},
            )
        )
        tokens: dict[str, list[int]] = {}
        for token in result.sampled:
            tokens.setdefault(token.req_id, []).append(token.token_id)
        for req_id in ids:
            out = tokens[req_id]
            assert 1 <= len(out) <= 3 and out[:-1] == drafts[: len(out) - 1]
            first[out[0]] += 1
            if len(out) > 1:
                second[out[1]] += 1
            computed = runner.requests[req_id].num_computed_tokens
            assert computed == len(prompt) + len(out) - 1  # rejected drafts rolled back
        runner.execute(StepPlan(step_id=2, finished_req_ids=ids))
    assert _total_variation(first, p0) < 0.04, (first / first.sum(), p0)
    assert second.sum() > 300 and _total_variation(second, p1) < 0.08, (second / second.sum(), p1)
