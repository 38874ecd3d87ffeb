"""n > 1 samples: one prefill, then forks that share the prompt's blocks (copy-on-write)."""

import pytest

from pagoda.step import BlockCopy
from scheduler_svc.core import FinishReason, Scheduler, SchedulerConfig

from .fake_executor import FakeExecutor, make_request, run_to_completion, step


def make(num_blocks=64, block_size=4, budget=64, caching=False):
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_model_len=128,
        enable_prefix_caching=caching,
    )
    return Scheduler(config), FakeExecutor(block_size, num_blocks)


def siblings(prompt, n, max_tokens=5):
    return [make_request(f"s{i}", prompt, max_tokens, seed=100 + i) for i in range(n)]


def alone_outputs(prompt, n, max_tokens=5):
    """Each sample run on its own, with its own seed: what the fork must reproduce."""
    outputs = {}
    for request in siblings(prompt, n, max_tokens):
        scheduler, executor = make()
        scheduler.add_requests([request])
        run_to_completion(scheduler, executor)
        outputs[request.req_id] = request.output_token_ids
    return outputs


@pytest.mark.parametrize("caching", [False, True])
def test_followers_fork_after_the_leader_prefill(caching):
    scheduler, executor = make(caching=caching)
    prompt = list(range(1, 11))  # 10 tokens: blocks [0-3][4-7][8 9 . .]
    requests = siblings(prompt, 3)
    scheduler.add_requests(requests)
    plan = scheduler.schedule()
    assert [n.req_id for n in plan.new_requests] == ["s0"] and plan.num_scheduled_tokens == {"s0": 10}
    scheduler.update_from_output(plan, executor.execute(plan))
    (leader_ids,) = scheduler.kv_cache_manager.block_ids("s0")
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"s0": 1, "s1": 1, "s2": 1}
    forks = {n.req_id: n for n in plan.new_requests}
    assert set(forks) == {"s1", "s2"}
    for new in forks.values():
        assert new.token_ids == prompt and new.num_computed_tokens == 9
        assert new.block_ids[0][:2] == leader_ids[:2] and new.block_ids[0][2] not in leader_ids
    assert plan.block_copies == [BlockCopy(leader_ids[2], forks[f"s{i}"].block_ids[0][2]) for i in (1, 2)]
    pool = scheduler.kv_cache_manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in leader_ids] == [3, 3, 1]
    assert pool.num_total_blocks - pool.num_free_blocks == 5  # the prompt is held once
    scheduler.update_from_output(plan, executor.execute(plan))
    assert all(r.num_cached_tokens == requests[0].num_cached_tokens for r in requests)
    run_to_completion(scheduler, executor)
    assert {r.req_id: r.output_token_ids for r in requests} == alone_outputs(prompt, 3)
    assert len({tuple(r.output_token_ids) for r in requests}) == 3  # own seeds, own tokens
    assert pool.num_free_blocks == pool.num_total_blocks


@pytest.mark.parametrize(
    ("prompt_len", "num_shared", "copies"),
    [(8, 1, 1), (9, 2, 0), (1, 0, 0), (4, 0, 1), (5, 1, 0)],
)
def test_fork_block_arithmetic(prompt_len, num_shared, copies):
    scheduler, executor = make()
    prompt = list(range(1, prompt_len + 1))
    scheduler.add_requests(siblings(prompt, 2))
    step(scheduler, executor)
    (leader_ids,) = scheduler.kv_cache_manager.block_ids("s0")
    plan = scheduler.schedule()
    (fork,) = plan.new_requests
    assert fork.block_ids[0][:num_shared] == leader_ids[:num_shared]
    assert len(fork.block_ids[0]) == num_shared + 1 and fork.block_ids[0][-1] not in leader_ids
    assert len(plan.block_copies) == copies
    scheduler.update_from_output(plan, executor.execute(plan))
    run_to_completion(scheduler, executor)


@pytest.mark.parametrize("caching", [False, True])
def test_followers_fall_back_when_the_leader_finishes_first(caching):
    scheduler, executor = make(caching=caching)
    prompt = list(range(1, 11))
    requests = siblings(prompt, 3)
    requests[0].max_tokens = 1
    scheduler.add_requests(requests)
    step(scheduler, executor)
    assert requests[0].finish_reason is FinishReason.LENGTH
    plan = scheduler.schedule()  # s1 now leads s2: it prefills normally, s2 waits for it
    assert [n.req_id for n in plan.new_requests] == ["s1"]
    assert plan.new_requests[0].num_computed_tokens == (8 if caching else 0)
    scheduler.update_from_output(plan, executor.execute(plan))
    plan = scheduler.schedule()
    assert [n.req_id for n in plan.new_requests] == ["s2"] and plan.new_requests[0].num_computed_tokens == 9
    scheduler.update_from_output(plan, executor.execute(plan))
    run_to_completion(scheduler, executor)
    expected = alone_outputs(prompt, 3)
    assert requests[1].output_token_ids == expected["s1"] and requests[2].output_token_ids == expected["s2"]


def test_followers_fall_back_when_the_leader_is_aborted_mid_prefill():
    scheduler, executor = make(budget=4)
    prompt = list(range(1, 11))
    requests = siblings(prompt, 3)
    scheduler.add_requests(requests)
    step(scheduler, executor)
    scheduler.finish_requests(["s0"], FinishReason.ABORTED)
    run_to_completion(scheduler, executor)
    expected = alone_outputs(prompt, 3)
    assert [r.output_token_ids for r in requests[1:]] == [expected["s1"], expected["s2"]]


def test_aborted_follower_is_dropped_from_its_group():
    scheduler, executor = make()
    requests = siblings([1, 2, 3, 4, 5], 3)
    scheduler.add_requests(requests)
    scheduler.finish_requests("s1", FinishReason.ABORTED)
    step(scheduler, executor)
    plan = scheduler.schedule()
    assert [n.req_id for n in plan.new_requests] == ["s2"]
    scheduler.update_from_output(plan, executor.execute(plan))
    run_to_completion(scheduler, executor)


def test_followers_fall_back_when_the_leader_is_preempted_before_the_fork():
    scheduler, executor = make(num_blocks=5, block_size=4)  # 4 blocks
    other = make_request("other", [7, 7, 7, 7], 3, priority=-1)
    scheduler.add_requests([other])
    prompt = list(range(1, 10))  # 9 tokens: 3 blocks, no block left to fork into
    requests = siblings(prompt, 3)
    scheduler.add_requests(requests)
    step(scheduler, executor)
    plan = scheduler.schedule()  # other needs a 2nd block: the leader s0 is the victim
    assert plan.finished_req_ids == ["s0"] and plan.new_requests == []
    scheduler.update_from_output(plan, executor.execute(plan))
    run_to_completion(scheduler, executor)
    assert {r.req_id: r.output_token_ids for r in requests} == alone_outputs(prompt, 3)


def test_prompts_must_match():
    scheduler, _ = make()
    with pytest.raises(ValueError, match="different prompt"):
        scheduler.add_requests([make_request("a", [1, 2]), make_request("b", [1, 3])])
    assert not scheduler.has_unfinished()
