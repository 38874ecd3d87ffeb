"""The pooling runner's core scheduler: whole inputs under the token budget, no KV, nothing kept.

A fake pooling executor answers each PoolRequest with values that depend on its whole input,
so a result routed to the wrong request, or an input cut or resent differently, is caught.
"""

from __future__ import annotations

import pytest

from pagoda.step import PooledOutput, PoolRequest, PoolTask, RequestError, StepPlan, StepResult
from scheduler_svc.core import FinishReason, PoolingRequest, PoolingScheduler, PoolingSchedulerConfig, RequestStatus


def fake_values(request: PoolRequest) -> list[float]:
    """The fake model: a vector of the input (token ids and token types), cut to `dimensions`."""
    values = [float(sum(request.token_ids)), float(len(request.token_ids)), float(sum(request.token_type_ids)), 1.0]
    return values[: request.dimensions] if request.dimensions else values


def run(plan: StepPlan, fail: set[str] = frozenset()) -> StepResult:
    assert not plan.new_requests and not plan.cached_requests and not plan.num_scheduled_tokens and not plan.block_copies
    return StepResult(
        step_id=plan.step_id,
        pooled=[PooledOutput(r.req_id, fake_values(r)) for r in plan.pool_requests if r.req_id not in fail],
        errors=[RequestError(req_id, "boom") for req_id in sorted(fail)],
    )


def request(req_id: str, num_tokens: int, **kw) -> PoolingRequest:
    return PoolingRequest(PoolRequest(req_id, list(range(1, num_tokens + 1)), PoolTask.EMBED, **kw))


def make(budget=16, max_num_seqs=8, max_model_len=24) -> PoolingScheduler:
    return PoolingScheduler(PoolingSchedulerConfig(budget, max_num_seqs, max_model_len))


def test_whole_inputs_fill_the_budget_in_order_without_overtaking():
    scheduler = make(budget=16, max_model_len=16)
    scheduler.add_requests([request("a", 6), request("b", 6), request("c", 8), request("d", 1)])
    plan = scheduler.schedule()
    # c (8 tokens) does not fit the 4 left: it stops admission, d waits behind it
    assert [r.req_id for r in plan.pool_requests] == ["a", "b"]
    assert [len(r.token_ids) for r in plan.pool_requests] == [6, 6]  # never chunked
    scheduler.check_integrity()
    updates = scheduler.update_from_output(plan, run(plan))
    assert [(u.req_id, u.values[:2]) for u in updates] == [("a", [21.0, 6.0]), ("b", [21.0, 6.0])]
    scheduler.check_integrity()
    plan = scheduler.schedule()
    assert [r.req_id for r in plan.pool_requests] == ["c", "d"]
    scheduler.update_from_output(plan, run(plan))
    scheduler.check_integrity()
    assert not scheduler.has_unfinished() and scheduler.stats().num_total_blocks == 0


def test_an_input_longer_than_the_token_budget_runs_alone_in_one_step():
    scheduler = make(budget=8, max_model_len=24)  # the step budget is at least max_model_len
    scheduler.add_requests([request("long", 24), request("short", 1)])
    plan = scheduler.schedule()
    assert [r.req_id for r in plan.pool_requests] == ["long"]
    assert len(plan.pool_requests[0].token_ids) == 24
    with pytest.raises(ValueError, match="more than max_model_len"):
        scheduler.add_requests([request("too-long", 25)])


def test_max_num_seqs_bounds_a_step_and_admission():
    scheduler = make(budget=100, max_num_seqs=3)
    assert scheduler.can_admit([request("x", 1)])
    scheduler.add_requests([request(f"r{i}", 2) for i in range(3)])
    assert not scheduler.can_admit([request("x", 1)])  # late binding: it waits in the engine's queue
    plan = scheduler.schedule()
    assert len(plan.pool_requests) == 3


def test_can_admit_keeps_a_second_step_of_work_in_the_engines_queue():
    scheduler = make(budget=16, max_model_len=16)
    scheduler.add_requests([request("a", 10)])
    assert scheduler.can_admit([request("b", 6)])
    assert not scheduler.can_admit([request("b", 7)])  # 17 tokens would not start next step


def test_async_steps_apply_in_order_and_a_result_must_answer_its_plan():
    scheduler = make(budget=8, max_model_len=8)
    scheduler.add_requests([request("a", 8), request("b", 8)])
    first, second = scheduler.schedule(), scheduler.schedule()  # planned ahead
    assert scheduler.num_steps_in_flight == 2
    scheduler.check_integrity()
    with pytest.raises(ValueError, match="oldest"):
        scheduler.update_from_output(second, run(second))
    missing = StepResult(step_id=first.step_id)
    with pytest.raises(ValueError, match="do not answer"):
        scheduler.update_from_output(first, missing)
    bad = run(first)
    bad.pooled[0].values = [float("nan")]
    with pytest.raises(ValueError, match="not finite"):
        scheduler.update_from_output(first, bad)
    scheduler.check_integrity()  # nothing changed
    assert [u.req_id for u in scheduler.update_from_output(first, run(first))] == ["a"]
    assert [u.req_id for u in scheduler.update_from_output(second, run(second))] == ["b"]
    scheduler.check_integrity()


def test_dimensions_are_checked_against_the_answer():
    scheduler = make()
    scheduler.add_requests([request("a", 3, dimensions=2)])
    plan = scheduler.schedule()
    wrong = StepResult(plan.step_id, pooled=[PooledOutput("a", [1.0, 2.0, 3.0])])
    with pytest.raises(ValueError, match="asked for 2 dimensions"):
        scheduler.update_from_output(plan, wrong)
    assert scheduler.update_from_output(plan, run(plan))[0].values == [6.0, 3.0]


def test_an_aborted_request_in_flight_gets_nothing_and_an_error_finishes_only_its_request():
    scheduler = make()
    scheduler.add_requests([request("a", 2), request("b", 2), request("c", 2)])
    plan = scheduler.schedule()
    assert [r.req_id for r in scheduler.finish_requests("a", FinishReason.ABORTED)] == ["a"]
    scheduler.check_integrity()
    updates = scheduler.update_from_output(plan, run(plan, fail={"c"}))
    assert [u.req_id for u in updates] == ["b"]
    scheduler.check_integrity()
    assert not scheduler.has_unfinished()


def test_a_lost_executors_requests_run_again_elsewhere_with_the_same_values():
    lost, survivor = make(), make()
    lost.add_requests([request("a", 5, token_type_ids=[0, 0, 1, 1, 1]), request("b", 4)])
    lost.schedule()  # in flight when the executor dies
    drained = lost.drain()
    assert [r.req_id for r in drained] == ["a", "b"] and all(r.status is RequestStatus.WAITING for r in drained)
    lost.check_integrity()
    survivor.add_requests(drained)
    plan = survivor.schedule()
    values = {u.req_id: u.values for u in survivor.update_from_output(plan, run(plan))}
    assert values == {"a": [15.0, 5.0, 3.0, 1.0], "b": [10.0, 4.0, 0.0, 1.0]}
    survivor.check_integrity()


def test_take_movable_hands_every_waiting_request_back():
    scheduler = make(budget=4, max_model_len=4)
    scheduler.add_requests([request("a", 4), request("b", 4)])
    plan = scheduler.schedule()
    assert [r.req_id for r in scheduler.take_movable()] == ["b"]
    scheduler.update_from_output(plan, run(plan))
    scheduler.check_integrity()
    assert not scheduler.has_unfinished()
