"""Preemption: victim choice, no admission in that step, resumption with every token."""

from scheduler_svc.core import RequestStatus, Scheduler, SchedulerConfig

from .fake_executor import FakeExecutor, make_request, run_to_completion, step


def make(num_blocks, block_size=2, budget=64, caching=False):
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_model_len=64,
        enable_prefix_caching=caching,
    )
    return Scheduler(config), FakeExecutor(block_size, num_blocks)


def add(scheduler, req_id, prompt, max_tokens=8, **kwargs):
    request = make_request(req_id, prompt, max_tokens, **kwargs)
    scheduler.add_requests([request])
    return request


def test_latest_arrival_is_preempted_and_nobody_is_admitted_that_step():
    scheduler, executor = make(num_blocks=5)  # 4 blocks of 2
    a = add(scheduler, "a", [1, 2, 3], arrival_time=0.0)
    b = add(scheduler, "b", [4, 5, 6], arrival_time=1.0)
    step(scheduler, executor)  # a, b: 2 blocks each, 4 tokens after their first sample
    add(scheduler, "c", [7], priority=-1, arrival_time=2.0)  # first in the waiting queue
    add(scheduler, "d", [8], arrival_time=3.0)
    plan = scheduler.schedule()  # both decode position 3: still 2 blocks each, c does not fit
    assert set(plan.num_scheduled_tokens) == {"a", "b"}
    scheduler.update_from_output(plan, executor.execute(plan))
    plan = scheduler.schedule()  # a needs a 3rd block: b is preempted; c would fit now but must wait
    assert plan.finished_req_ids == ["b"]
    assert plan.num_scheduled_tokens == {"a": 1} and plan.new_requests == []
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert scheduler.num_preemptions == 1 and scheduler.stats().num_preemptions == 1
    assert [r.req_id for r in scheduler.waiting] == ["c", "b", "d"]  # b ahead of later arrivals
    scheduler.update_from_output(plan, executor.execute(plan))
    plan = scheduler.schedule()  # no preemption this time: c is admitted
    assert [n.req_id for n in plan.new_requests] == ["c"]
    scheduler.update_from_output(plan, executor.execute(plan))
    assert a.status is RequestStatus.RUNNING


def test_victim_is_lowest_priority_before_latest_arrival():
    scheduler, executor = make(num_blocks=5)
    low = add(scheduler, "low", [1, 2, 3], priority=1, arrival_time=0.0)
    add(scheduler, "high", [4, 5, 6], priority=0, arrival_time=1.0)
    step(scheduler, executor)
    step(scheduler, executor)
    plan = scheduler.schedule()
    assert plan.finished_req_ids == ["low"]  # the earlier arrival, but the larger priority value
    assert low.status is RequestStatus.PREEMPTED
    scheduler.update_from_output(plan, executor.execute(plan))


def test_a_request_preempts_itself_when_it_is_the_victim():
    scheduler, executor = make(num_blocks=5)  # 4 blocks of 2
    add(scheduler, "first", [1, 2, 3], arrival_time=0.0)
    last = add(scheduler, "last", [4, 5, 6, 7], arrival_time=1.0)
    step(scheduler, executor)  # 2 blocks each
    plan = scheduler.schedule()  # first writes position 3 (held); last needs a block for 4
    assert plan.finished_req_ids == ["last"]
    assert plan.num_scheduled_tokens == {"first": 1}
    assert last.status is RequestStatus.PREEMPTED
    scheduler.update_from_output(plan, executor.execute(plan))


def test_resumed_request_is_sent_with_every_token_and_same_outputs():
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8]}
    outputs = {}
    for num_blocks in (64, 6):
        scheduler, executor = make(num_blocks=num_blocks)
        requests = [
            add(scheduler, req_id, prompt, 6, arrival_time=i) for i, (req_id, prompt) in enumerate(prompts.items())
        ]
        seen, resumed = set(), []
        while scheduler.has_unfinished():
            plan = scheduler.schedule()
            resumed += [new for new in plan.new_requests if new.req_id in seen]
            seen.update(new.req_id for new in plan.new_requests)
            scheduler.update_from_output(plan, executor.execute(plan))
        outputs[num_blocks] = {r.req_id: r.output_token_ids for r in requests}
        if num_blocks == 6:
            assert scheduler.num_preemptions > 0 and resumed
            for new in resumed:
                assert new.num_prompt_tokens == len(prompts[new.req_id])
                assert new.token_ids[: new.num_prompt_tokens] == prompts[new.req_id]
                assert len(new.token_ids) > new.num_prompt_tokens  # the outputs so far come too
                assert new.num_computed_tokens == 0
    assert outputs[64] == outputs[6]


def test_resumption_hits_its_own_cached_blocks():
    scheduler, executor = make(num_blocks=7, caching=True)  # 6 blocks of 2
    a = add(scheduler, "a", [1, 2, 3], 4, arrival_time=0.0)
    b = add(scheduler, "b", [9, 9, 9, 9, 9], 20, arrival_time=1.0)
    step(scheduler, executor)  # a: 2 blocks, b: 3 blocks (2 full, cached)
    step(scheduler, executor)  # b fills its 3rd block: cached too
    plan = scheduler.schedule()  # a takes the last block; b needs one more: preempts itself
    assert plan.finished_req_ids == ["b"]
    scheduler.update_from_output(plan, executor.execute(plan))
    step(scheduler, executor)  # a's last token (LENGTH); b's hit is evictable: not admitted
    assert a.is_finished and b.status is RequestStatus.PREEMPTED
    plan = scheduler.schedule()
    (new,) = plan.new_requests
    assert new.token_ids == b.all_token_ids and len(new.token_ids) == 7
    assert new.num_computed_tokens == 6 and plan.num_scheduled_tokens == {"b": 1}
    assert b.num_cached_tokens == 0  # measured at its first scheduling
    scheduler.update_from_output(plan, executor.execute(plan))
    run_to_completion(scheduler, executor)
    stats = scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
