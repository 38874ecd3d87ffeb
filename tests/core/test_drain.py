"""drain(): an executor dies, its requests resume on another executor's scheduler."""

from scheduler_svc.core import RequestStatus, Scheduler, SchedulerConfig

from .fake_executor import FakeExecutor, make_request, run_to_completion, step


def make(block_size=4, num_blocks=64, caching=True):
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=16,
        max_model_len=128,
        enable_prefix_caching=caching,
    )
    return Scheduler(config), FakeExecutor(block_size, num_blocks)


def workload():
    groups = [[make_request("solo", list(range(1, 30)), 8, seed=1)]]
    groups.append([make_request(f"n{i}", [5, 6, 7, 8, 9, 10], 8, seed=10 + i) for i in range(3)])
    groups.append([make_request("short", [3, 3], 8, seed=3, priority=1)])
    return groups


def add_all(scheduler, groups):
    for group in groups:
        scheduler.add_requests(group)
    return [request for group in groups for request in group]


def test_drain_then_resume_elsewhere_gives_the_same_outputs():
    first, first_executor = make()
    requests = add_all(first, workload())
    for _ in range(4):
        step(first, first_executor)
    in_flight = first.schedule()
    first_executor.execute(in_flight)  # the executor dies before its result arrives
    progress = {r.req_id: list(r.all_token_ids) for r in requests}
    drained = first.drain()
    assert {r.req_id for r in drained} == {r.req_id for r in requests if not r.is_finished}
    assert all(r.num_computed_tokens == 0 and r.status is RequestStatus.WAITING for r in drained)
    assert not first.has_unfinished()
    first.check_integrity()
    stats = first.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0
    assert first.kv_cache_manager.req_ids() == set()
    second, second_executor = make(block_size=2, caching=False)  # a different executor
    for request in drained:
        second.add_requests([request])
    plan = second.schedule()
    for new in plan.new_requests:
        assert new.token_ids == progress[new.req_id] and new.num_computed_tokens == 0
    assert any(len(n.token_ids) > n.num_prompt_tokens for n in plan.new_requests)
    second.update_from_output(plan, second_executor.execute(plan))
    run_to_completion(second, second_executor)
    assert {r.req_id: r.output_token_ids for r in requests} == expected_outputs()


def expected_outputs():
    scheduler, executor = make()
    requests = add_all(scheduler, workload())
    run_to_completion(scheduler, executor)
    return {r.req_id: r.output_token_ids for r in requests}


def test_drain_of_an_idle_scheduler_is_empty():
    scheduler, _ = make()
    assert scheduler.drain() == []
