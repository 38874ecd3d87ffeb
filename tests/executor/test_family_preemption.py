"""Every supported family preempted mid-decode by the core scheduler and resumed: the same tokens and
log-probabilities as never preempted, and as transformers (#21 point 5).

Three greedy requests (prompts of 26, 29 and 27 tokens, 24 tokens each) served through the real
core scheduler and model runner (`run_with_scheduler`: plans and results through the wire
protobufs), block size 4, prefill chunks of 8. The first two start together in a KV pool that
holds just them to their ends; the third, of a higher priority, arrives while the second
decodes, and its prefill makes the scheduler itself preempt from the back of the running queue:
the second request, mid-decode, its blocks freed. It comes back later, recomputed from its prompt
and the tokens it had (without prefix caching all of them; with it, what the cache lost), maybe
preempted again while it recomputes. Every request's tokens and per-token log-probabilities
equal a run in a roomy pool (never preempted) and transformers'. The sliding families (window 16)
are preempted after their window has moved -- their windowed groups' first blocks already freed,
the null block leading those tables -- so the resumed prefill recomputes the windowed groups
too, freeing their blocks outside the window again as it goes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from executor_svc.model_runner import ModelRunner
from pagoda.step import SamplingParams
from scheduler_svc.core import Request, RequestStatus, Scheduler, SchedulerConfig
from tests.executor.plans import run_with_scheduler
from tests.executor.test_model_runner import hf_greedy
from tests.model_families import FAMILIES, SLIDING, WINDOW, build_family, load_reference

BLOCK_SIZE = 4
CHUNK = 8  # max_num_batched_tokens
MAX_TOKENS = 24
# past the window by more than a block: their windowed groups' first blocks are freed in the prefill
PROMPT_LENGTHS = (26, 29, 27)
LATE_AFTER = 4  # the third request (priority -1) arrives once the second has this many tokens
ROOMY = 200  # blocks: nothing is preempted
GREEDY_LOGPROBS = SamplingParams(temperature=0.0, logprobs=True)
NULL_BLOCK_ID = 0  # (`KVCacheManager.block_ids`: a freed windowed entry)


@dataclass(frozen=True)
class Preemption:
    req_id: str
    num_output_tokens: int  # at the preemption
    decoding: bool  # its last step computed its last token but one, the one sampled before
    block_ids: tuple[list[int], ...]  # its tables in the step before, one per group


@dataclass
class Served:
    requests: list[Request]
    logprobs: dict[str, list[float]]  # each sampled token's, in order
    preemptions: list[Preemption]
    resumptions: dict[str, list[tuple[int, int]]]  # per resumption: (its tokens, of them a prefix-cache hit)
    windowed_group_ids: list[int]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, default_model_dir):
    return {kind: build_family(kind, tmp_path_factory.mktemp(f"family-{kind}"), default_model_dir) for kind in FAMILIES}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, 40000, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def serve(model_dir, prompts: list[list[int]], tight: bool, enable_prefix_caching: bool = True) -> Served:
    """Serve the prompts to the end through the core scheduler: the first two at once, the third
    (priority -1) once the second has `LATE_AFTER` tokens. `tight`: a pool that holds the first two
    to their ends (`SchedulerConfig.max_blocks_per_request`) and nothing more, so the third's
    prefill preempts from the back of the running queue -- the second request, decoding."""
    runner = ModelRunner(model_dir, device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=ROOMY)
    groups = runner.kv_cache_groups

    def config(num_blocks: int) -> SchedulerConfig:
        return SchedulerConfig(
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            max_model_len=runner.max_model_len,
            kv_cache_groups=groups,
            max_num_batched_tokens=CHUNK,
            max_num_seqs=4,
            enable_prefix_caching=enable_prefix_caching,
        )

    num_blocks = ROOMY
    if tight:  # (+ 1: the null block)
        num_blocks = 1 + sum(config(ROOMY).max_blocks_per_request(len(p) + MAX_TOKENS) for p in prompts[:2])
    scheduler = Scheduler(config(num_blocks))
    requests = [Request(f"r{i}", prompt, GREEDY_LOGPROBS, max_tokens=MAX_TOKENS) for i, prompt in enumerate(prompts)]
    requests[2].priority = -1
    by_id = {request.req_id: request for request in requests}
    served = Served(
        requests,
        {request.req_id: [] for request in requests},
        [],
        {request.req_id: [] for request in requests},
        [i for i, group in enumerate(groups) if group.sliding_window is not None],
    )
    held: dict[str, tuple[int, tuple[list[int], ...]]] = {}  # after each step: tokens computed, tables
    execute = runner.execute

    def execute_recording(plan):
        for req_id in plan.finished_req_ids:
            request = by_id[req_id]
            if request.status is RequestStatus.PREEMPTED:
                num_computed, block_ids = held[req_id]
                decoding = num_computed == request.num_tokens - 1 and request.num_output_tokens > 0
                served.preemptions.append(Preemption(req_id, request.num_output_tokens, decoding, block_ids))
        for new in plan.new_requests:
            if by_id[new.req_id].num_preemptions:
                served.resumptions[new.req_id].append((len(new.token_ids), new.num_computed_tokens))
        result = execute(plan)
        for token in result.sampled:
            served.logprobs[token.req_id].append(token.logprob)
        for request in requests:
            held[request.req_id] = (request.num_computed_tokens, scheduler.kv_cache_manager.block_ids(request.req_id))
        if not late and requests[1].num_output_tokens >= LATE_AFTER:
            scheduler.add_requests([requests[2]])
            late.append(requests[2])
        return result

    late: list[Request] = []
    runner.execute = execute_recording  # (an instance attribute: this runner only)
    for request in requests[:2]:
        scheduler.add_requests([request])
    run_with_scheduler(runner, scheduler)
    stats = scheduler.stats()
    assert late and stats.num_free_blocks == stats.num_total_blocks and not runner.requests
    assert scheduler.num_preemptions == len(served.preemptions)
    return served


def transformers_logprobs(reference, prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]
    return logits.float().log_softmax(-1).gather(1, torch.tensor(output)[:, None])[:, 0]


@pytest.fixture(scope="module")
def roomy_runs(family_dirs, prompts) -> Callable[[str], Served]:
    """Per family, the prompts in a pool that holds them: never preempted (computed once)."""
    runs = {}

    def get(kind: str) -> Served:
        if kind not in runs:
            runs[kind] = serve(family_dirs[kind], prompts, tight=False)
            assert not runs[kind].preemptions, kind
        return runs[kind]

    return get


@pytest.mark.parametrize("enable_prefix_caching", [False, True], ids=["recompute", "prefix-caching"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_preempted_mid_decode_resumes_with_the_same_tokens_and_logprobs(
    kind, enable_prefix_caching, family_dirs, prompts, roomy_runs
):
    assert min(PROMPT_LENGTHS) > WINDOW + BLOCK_SIZE
    served = serve(family_dirs[kind], prompts, tight=True, enable_prefix_caching=enable_prefix_caching)
    mid_decode = [p for p in served.preemptions if p.decoding]
    assert mid_decode, served.preemptions
    assert bool(served.windowed_group_ids) == (kind in SLIDING)
    for preemption in mid_decode:  # the window had moved: each windowed table led by the null block
        assert 0 < preemption.num_output_tokens < MAX_TOKENS
        assert all(preemption.block_ids[g][0] == NULL_BLOCK_ID for g in served.windowed_group_ids), preemption
    for req_id in {p.req_id for p in mid_decode}:
        resumptions = served.resumptions[req_id]
        assert resumptions and all(num_hit < num_tokens for num_tokens, num_hit in resumptions), resumptions
        if not enable_prefix_caching:  # every token computed again
            assert all(num_hit == 0 for _, num_hit in resumptions), resumptions
    never_preempted = roomy_runs(kind)
    reference = load_reference(family_dirs[kind])
    for request, alone in zip(served.requests, never_preempted.requests, strict=True):
        assert request.num_output_tokens == MAX_TOKENS, request.req_id  # (not capped by the small pool)
        assert request.output_token_ids == alone.output_token_ids, request.req_id
        ours = torch.tensor(served.logprobs[request.req_id])
        torch.testing.assert_close(ours, torch.tensor(never_preempted.logprobs[request.req_id]), atol=2e-5, rtol=0)
        expected = hf_greedy(reference, request.prompt_token_ids, MAX_TOKENS)
        assert len(expected) >= 8 and request.output_token_ids[: len(expected)] == expected, request.req_id
        theirs = transformers_logprobs(reference, request.prompt_token_ids, request.output_token_ids)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
