"""The token-budget rule: running first, chunked prefill, max_num_seqs, priority, FCFS."""

import pytest

from pagoda.step import SampledToken, StepResult
from scheduler_svc.core import FinishReason, Scheduler, SchedulerConfig

from .fake_executor import FakeExecutor, make_request, step


def make(num_blocks=64, block_size=4, budget=8, max_num_seqs=8, max_model_len=256, caching=False):
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=caching,
    )
    return Scheduler(config), FakeExecutor(block_size, num_blocks)


def run_plan(scheduler, executor):
    plan = scheduler.schedule()
    return plan, scheduler.update_from_output(plan, executor.execute(plan))


def test_long_prompt_is_chunked_and_new_requests_take_the_rest():
    scheduler, executor = make(budget=8)
    scheduler.add_requests([make_request("a", list(range(20)), 3)])
    plan, updates = run_plan(scheduler, executor)
    (new,) = plan.new_requests
    assert new.token_ids == list(range(20)) and new.num_prompt_tokens == 20
    assert new.num_computed_tokens == 0 and new.block_ids == ([1, 2],)
    assert plan.num_scheduled_tokens == {"a": 8} and updates == []
    plan, _ = run_plan(scheduler, executor)
    assert plan.new_requests == [] and plan.num_scheduled_tokens == {"a": 8}
    assert [(c.req_id, c.new_block_ids) for c in plan.cached_requests] == [("a", ([3, 4],))]
    scheduler.add_requests([make_request("b", list(range(30, 40)), 3)])
    plan, updates = run_plan(scheduler, executor)
    assert plan.num_scheduled_tokens == {"a": 4, "b": 4}  # a's last chunk first, b gets the rest
    assert [u.req_id for u in updates] == ["a"]  # a's prompt is done: first token
    plan, updates = run_plan(scheduler, executor)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 6}  # decode first, then the prefill chunk
    assert [u.req_id for u in updates] == ["a", "b"]


def test_max_num_seqs_bounds_admission():
    scheduler, executor = make(budget=100, max_num_seqs=2)
    for i in range(3):
        scheduler.add_requests([make_request(f"r{i}", [1, 2, 3], 8)])
    plan, _ = run_plan(scheduler, executor)
    assert sorted(plan.num_scheduled_tokens) == ["r0", "r1"]
    assert scheduler.stats().num_waiting == 1


def test_waiting_order_is_priority_then_arrival():
    scheduler, executor = make(budget=100, max_num_seqs=1)
    scheduler.add_requests([make_request("late-low", [1, 2], 1, priority=1, arrival_time=0.0)])
    scheduler.add_requests([make_request("high", [1, 2], 1, priority=0, arrival_time=2.0)])
    scheduler.add_requests([make_request("early-low", [1, 2], 1, priority=1, arrival_time=-1.0)])
    scheduler.add_requests([make_request("urgent", [1, 2], 1, priority=-5, arrival_time=9.0)])
    order = []
    while scheduler.has_unfinished():
        order.extend(u.req_id for u in step(scheduler, executor))
    assert order == ["urgent", "high", "early-low", "late-low"]


def test_head_of_queue_that_does_not_fit_blocks_later_ones():
    scheduler, executor = make(num_blocks=5, block_size=4, budget=100)  # 4 usable blocks
    scheduler.add_requests([make_request("a", list(range(9)), 8)])  # 3 blocks
    step(scheduler, executor)
    scheduler.add_requests([make_request("b", list(range(9)), 1)])  # needs 3: does not fit
    scheduler.add_requests([make_request("c", [1], 1)])  # would fit, but must not overtake b
    plan, _ = run_plan(scheduler, executor)
    assert plan.num_scheduled_tokens == {"a": 1}


def test_stop_conditions():
    scheduler, _ = make(max_model_len=9, budget=100)
    eos = make_request("eos", [1, 2, 3], 10, stop_token_ids=(2, 7), min_tokens=2)
    eos.eos_token_ids = frozenset({2})
    stop = make_request("stop", [1, 2, 3], 10, stop_token_ids=(2, 7))
    stop.eos_token_ids = frozenset({2})
    length = make_request("length", [1, 2, 3], 2)
    model_len = make_request("model-len", [1, 2, 3, 4, 5, 6], 10)
    for request in (eos, stop, length, model_len):
        scheduler.add_requests([request])
    tokens = {"eos": [2, 5, 2], "stop": [7], "length": [5, 5], "model-len": [5, 5, 5]}
    finished = {}
    for turn in range(3):
        plan = scheduler.schedule()
        sampled = [SampledToken(req_id, tokens[req_id][turn]) for req_id in plan.num_scheduled_tokens]
        for update in scheduler.update_from_output(plan, StepResult(plan.step_id, sampled)):
            if update.finish_reason is not None:
                finished[update.req_id] = (update.finish_reason.name, turn)
    # eos: token 2 at turn 0 is below min_tokens; at turn 2 (3rd token) it stops as EOS.
    assert finished == {
        "eos": ("EOS", 2),
        "stop": ("STOP_TOKEN", 0),
        "length": ("LENGTH", 1),
        "model-len": ("LENGTH", 2),  # 6 + 3 tokens reach max_model_len 9
    }
    assert eos.output_token_ids == [2, 5, 2] and eos.finish_reason.name == "EOS"
    assert not scheduler.has_unfinished()
    stats = scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_finish_requests_frees_at_once_and_is_idempotent():
    scheduler, executor = make(budget=100)
    scheduler.add_requests([make_request("run", [1, 2, 3, 4, 5], 8)])
    scheduler.add_requests([make_request("x", [1, 2, 3, 4, 6], 8)])
    step(scheduler, executor)
    scheduler.add_requests([make_request("wait", [9] * 5, 8)])
    used = scheduler.stats().num_total_blocks - scheduler.stats().num_free_blocks
    done = scheduler.finish_requests(["run", "wait", "unknown"], FinishReason.ABORTED)
    assert [r.req_id for r in done] == ["run", "wait"]
    assert all(r.finish_reason is FinishReason.ABORTED for r in done)
    assert scheduler.stats().num_total_blocks - scheduler.stats().num_free_blocks == used - 2
    assert scheduler.finish_requests("run", FinishReason.ABORTED) == []
    assert scheduler.pending_finished_req_ids == ("run",)  # "wait" never reached the executor
    plan = scheduler.schedule()
    assert plan.finished_req_ids == ["run"]
    scheduler.update_from_output(plan, executor.execute(plan))


def test_abort_while_the_step_runs_ignores_its_result():
    scheduler, executor = make(budget=100)
    scheduler.add_requests([make_request("a", [1, 2, 3], 8)])
    scheduler.add_requests([make_request("b", [4, 5, 6], 8)])
    plan = scheduler.schedule()
    result = executor.execute(plan)
    scheduler.finish_requests(["a"], FinishReason.STOP_SEQUENCE)
    updates = scheduler.update_from_output(plan, result)
    assert [u.req_id for u in updates] == ["b"]
    assert step(scheduler, executor)  # the executor drops "a" next step; views agree


def test_protocol_misuse_is_refused():
    scheduler, executor = make(budget=100)
    scheduler.add_requests([make_request("a", [1, 2, 3], 4)])
    with pytest.raises(ValueError, match="in flight"):
        scheduler.add_requests([make_request("a", [1], 4)])
    plan = scheduler.schedule()
    result = executor.execute(plan)
    ahead = scheduler.schedule()  # planning ahead is allowed (async scheduling); results come in order
    assert ahead.num_scheduled_tokens == {"a": 1}
    with pytest.raises(ValueError, match="oldest step in flight"):
        scheduler.update_from_output(ahead, StepResult(ahead.step_id))
    with pytest.raises(ValueError):
        scheduler.update_from_output(plan, StepResult(plan.step_id + 1))
    with pytest.raises(ValueError, match="tokens missing"):
        scheduler.update_from_output(plan, StepResult(plan.step_id))
    scheduler.update_from_output(plan, result)
    scheduler.update_from_output(ahead, executor.execute(ahead))


def test_requests_that_can_never_fit_are_refused():
    scheduler, _ = make(num_blocks=5, block_size=4, max_model_len=100)  # 16 KV slots
    assert scheduler.config.max_seq_len == 16
    assert scheduler.can_fit(16) and not scheduler.can_fit(17)
    with pytest.raises(ValueError, match="max_seq_len 16"):
        scheduler.add_requests([make_request("big", list(range(16)), 4)])
    scheduler.add_requests([make_request("ok", list(range(15)), 4)])
    with pytest.raises(ValueError):
        SchedulerConfig(num_blocks=1)
    with pytest.raises(ValueError, match="block_size"):
        SchedulerConfig(num_blocks=8, block_size=0)


def test_idle_stats():
    scheduler, executor = make(num_blocks=9, caching=True, budget=100)
    stats = scheduler.stats()
    assert (stats.num_total_blocks, stats.num_free_blocks, stats.num_running) == (8, 8, 0)
    scheduler.add_requests([make_request("a", list(range(10)), 2)])
    step(scheduler, executor)
    stats = scheduler.stats()
    assert stats.kv_slots_allocated == 12 and stats.kv_tokens_held == 10
    while scheduler.has_unfinished():
        step(scheduler, executor)
    stats = scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks == 8
    assert stats.num_cached_blocks == 2 and stats.kv_slots_allocated == 0


def test_an_empty_plan_carries_finished_ids_and_needs_no_result():
    scheduler, executor = make(budget=100)
    scheduler.add_requests([make_request("a", [1, 2, 3], 8)])
    step(scheduler, executor)
    scheduler.finish_requests(["a"], FinishReason.ABORTED)
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {} and plan.finished_req_ids == ["a"]
    executor.execute(plan)
    scheduler.add_requests([make_request("b", [4, 5], 8)])
    in_flight = scheduler.schedule()  # an empty plan's result is optional
    assert scheduler.update_from_output(plan, StepResult(plan.step_id)) == []
    assert scheduler.num_steps_in_flight == 1  # the empty plan's result did not clear the step in flight
    scheduler.update_from_output(in_flight, executor.execute(in_flight))
    assert scheduler.num_steps_in_flight == 0
    assert executor.states.keys() == {"b"}
