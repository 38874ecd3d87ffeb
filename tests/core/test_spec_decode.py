"""Speculative decoding in the scheduler core: prompt-lookup drafts, rollback, block reuse.

The fake executor verifies drafts against its own model and rolls back as a real one
does; its fingerprint KV cache catches a computed count that was not rolled back, or a
block of rejected drafts that entered the prefix cache.
"""

import dataclasses

import pytest
from hypothesis import HealthCheck, settings

from scheduler_svc.core import Scheduler, SchedulerConfig, SpeculativeConfig
from scheduler_svc.core.spec_decode import MAX_DRAFT_PAUSE, DraftBackoff, NgramProposer

from .fake_executor import AheadDriver, FakeExecutor, make_request, next_token, reference_output, run_to_completion, step
from .test_scheduler_properties import SchedulerMachine

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def config(**kwargs) -> SchedulerConfig:
    return SchedulerConfig(**{"num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 64, "speculative": SPEC, **kwargs})


# ---- the proposer -----------------------------------------------------------------------


def test_proposer_continues_the_latest_match_of_the_longest_suffix():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3))
    #                  0  1  2  3  4  5  6  7  8  9 10
    assert proposer.propose([5, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2], 3) == [3, 7, 1]  # "1 2" latest at 5
    assert proposer.propose([1, 2, 3, 4, 8, 2, 3], 2) == [4, 8]  # "2 3" at 1
    assert proposer.propose([1, 2, 3, 4], 3) == []  # 4 never occurred before
    assert proposer.propose([7, 7], 5) == [7]  # the continuation is cut at the end of the text
    assert proposer.propose([1, 2, 1], 0) == []


def test_proposer_matches_whole_tokens_only():
    """Token ids whose bytes overlap a token boundary are no match."""
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=2))
    # bytes of 0x0100 0x0002 contain the bytes of 0x0001 0x0000 ... misaligned
    tokens = [0x00010000, 0x00000002, 0x00020000, 5, 0x01000000, 0x02000000]
    assert proposer.propose(tokens, 2) == []
    assert proposer.propose([3, 4, 9, 3, 4], 2) == [9, 3]


# ---- scheduling drafts ------------------------------------------------------------------


def test_predictable_text_is_generated_in_fewer_steps_with_the_same_tokens():
    request = make_request("a", [3, 1, 4, 1, 5], max_tokens=40)
    scheduler, executor = Scheduler(config()), FakeExecutor(4, 64, markov=True)
    scheduler.add_requests([request])
    run_to_completion(scheduler, executor)
    assert request.output_token_ids == reference_output(request, 10_000, markov=True)
    assert executor.num_drafts_accepted > 20 and executor.num_steps < 20
    assert request.num_accepted_draft_tokens == executor.num_drafts_accepted
    stats = scheduler.take_spec_decode_stats()
    assert stats.num_accepted_tokens == executor.num_drafts_accepted
    assert stats.num_accepted_tokens_per_pos[0] >= stats.num_accepted_tokens_per_pos[-1]
    assert scheduler.take_spec_decode_stats().num_drafts == 0  # taken


def prompt_with_drafts() -> tuple[list[int], list[int]]:
    """A prompt of 11 tokens for the markov fake, and the 4 drafts it gets after its first token.

    The model's token after 3 is x; "2 3 x" occurred before, followed by 4 tokens the
    model does not continue with.
    """
    x = next_token(3, None, 64)
    planted = [t for t in range(10, 20) if t != next_token(x, None, 64)][:4]
    return [1, 2, 3, x, *planted, 1, 2, 3], planted


def prefill(scheduler: Scheduler, executor: FakeExecutor, request) -> None:
    while not request.output_token_ids:
        step(scheduler, executor)


def test_rejected_drafts_roll_back_and_their_blocks_are_reused_next_step():
    prompt, planted = prompt_with_drafts()
    request = make_request("a", prompt, max_tokens=8)
    scheduler, executor = Scheduler(config(block_size=2, enable_prefix_caching=True)), FakeExecutor(2, 64, markov=True)
    scheduler.add_requests([request])
    step(scheduler, executor)  # the prompt
    plan = scheduler.schedule()
    assert plan.scheduled_spec_decode_tokens == {"a": planted}
    assert plan.num_scheduled_tokens == {"a": 5}
    (blocks_with_drafts,) = scheduler.kv_cache_manager.block_ids("a")
    assert len(blocks_with_drafts) == 8  # 12 tokens + 4 drafts: positions 0..15
    result = executor.execute(plan)
    assert [t.token_id for t in result.sampled] == [next_token(prompt[3], None, 64)]  # the model disagrees at once
    scheduler.update_from_output(plan, result)
    assert request.num_computed_tokens == 12 and request.num_tokens == 13
    assert scheduler.kv_cache_manager.block_ids("a") == (blocks_with_drafts,)  # kept
    # only the blocks of accepted tokens are cached: 12 computed -> 6 full blocks
    assert scheduler.kv_cache_manager.block_pool.num_cached_blocks == 6
    plan = scheduler.schedule()  # drafts paused after a miss: one token, on a block it holds
    assert plan.num_scheduled_tokens == {"a": 1} and not plan.scheduled_spec_decode_tokens
    assert plan.cached_requests[0].new_block_ids == ([],)
    scheduler.update_from_output(plan, executor.execute(plan))
    run_to_completion(scheduler, executor)
    assert request.output_token_ids == reference_output(request, 10_000, markov=True)
    stats = scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_drafts_fit_the_budget_the_length_limits_and_never_preempt():
    prompt, _ = prompt_with_drafts()
    cases = [
        (config(max_num_batched_tokens=3), {}, 2),  # budget: the last token + 2 drafts
        (config(), {"max_tokens": 3}, 1),  # 1 out, 1 draft, the model's own token is the 3rd
        (config(), {"max_tokens": 4}, 2),
        (config(max_model_len=14), {}, 1),  # 12 tokens + 1 draft + 1 token
        (config(), {}, 4),
    ]
    for cfg, kwargs, num_drafts in cases:
        scheduler, executor = Scheduler(cfg), FakeExecutor(4, 64, markov=True)
        request = make_request("a", prompt, **{"max_tokens": 8, **kwargs})
        scheduler.add_requests([request])
        prefill(scheduler, executor, request)
        plan = scheduler.schedule()
        assert len(plan.scheduled_spec_decode_tokens["a"]) == num_drafts, cfg
    # no free block for the drafts: they are dropped, nobody is preempted
    scheduler, executor = Scheduler(config(num_blocks=5, max_model_len=16)), FakeExecutor(4, 5, markov=True)
    scheduler.add_requests([make_request("a", prompt, max_tokens=4)])
    scheduler.add_requests([make_request("b", [9, 9, 9], max_tokens=4, arrival_time=1.0)])
    step(scheduler, executor)
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 0
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1}
    assert plan.scheduled_spec_decode_tokens == {} and plan.finished_req_ids == []
    assert scheduler.num_preemptions == 0


def test_a_request_whose_drafts_keep_failing_drafts_less_and_less():
    request = make_request("a", [1, 2], max_tokens=60)
    draft_steps = []
    for index in range(60):
        if DraftBackoff.may_draft(request):
            draft_steps.append(index)
            DraftBackoff.on_verified(request, 3, 1 if index == 51 else 0)
    assert MAX_DRAFT_PAUSE == 16
    assert draft_steps == [0, 3, 8, 17, 34, 51, 52, 55]  # pauses 2, 4, 8, 16, 16; an accepted draft ends them
    assert (request.num_draft_tokens, request.num_accepted_draft_tokens) == (3 * len(draft_steps), 1)


def test_planning_ahead_waits_for_the_result_of_a_drafting_step():
    """With steps planned ahead, a request with drafts in flight is not planned again before
    its result (its length is unknown): a request drafts only when no token of it is in
    flight, here every third step, when the driver lets the executor catch up."""
    requests = [make_request(f"r{i}", [5, 6, 7, i] * 3, max_tokens=30, arrival_time=i) for i in range(3)]
    scheduler, executor = Scheduler(config()), FakeExecutor(4, 64, markov=True)
    for request in requests:
        scheduler.add_requests([request])
    driver = AheadDriver(scheduler, executor)
    for index in range(200):
        if not scheduler.has_unfinished():
            break
        driver.step()
        if index % 3 == 0:
            while driver.in_flight:
                driver.apply_oldest()
    driver.run_to_completion()
    for request in requests:
        assert request.output_token_ids == reference_output(request, 10_000, markov=True)
    assert executor.num_drafts_accepted > 0


def test_speculation_gives_the_same_tokens_under_preemption():
    outputs = []
    for num_blocks in (200, 9):
        requests = [make_request(f"r{i}", [i, 1, 2, 3, 1, 2], max_tokens=20, arrival_time=i) for i in range(4)]
        scheduler = Scheduler(config(num_blocks=num_blocks, max_model_len=32))
        executor = FakeExecutor(4, num_blocks, vocab_size=8, markov=True)
        for request in requests:
            scheduler.add_requests([request])
        run_to_completion(scheduler, executor)
        outputs.append([r.output_token_ids for r in requests])
        assert executor.num_drafts_accepted > 0
        assert (scheduler.num_preemptions > 0) == (num_blocks == 9)
        stats = scheduler.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    assert outputs[0] == outputs[1]


# ---- random histories -------------------------------------------------------------------


class SpeculativeSchedulerMachine(SchedulerMachine):
    speculative = True
    vocab_size = 6


TestSpeculativeSchedulerMachine = SpeculativeSchedulerMachine.TestCase
TestSpeculativeSchedulerMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSpeculativeSchedulerMachine.pytestmark = [pytest.mark.slow]  # hundreds of random programs: make test, not make test-fast


def test_config_is_validated():
    for bad in (dict(num_speculative_tokens=0), dict(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2), dict(num_speculative_tokens=2, method="eagle")):
        try:
            SpeculativeConfig(**bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")
    assert dataclasses.replace(config(), speculative=None).speculative is None
