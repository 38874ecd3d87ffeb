"""LoRA adapters in the core scheduler: at most `max_loras` adapters a step, none starved, the adapter
in the plan and in the prefix-cache key."""

from dataclasses import replace

import pytest

from scheduler_svc.core import Scheduler, SchedulerConfig

from .fake_executor import FakeExecutor, make_request


def make(max_loras=2, budget=64, max_num_seqs=16, caching=True):
    config = SchedulerConfig(num_blocks=256, block_size=4, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             max_model_len=256, enable_prefix_caching=caching, max_loras=max_loras)
    return Scheduler(config), FakeExecutor(4, 256)


def with_lora(request, lora):
    request.lora = lora
    return request


def adapters_of(scheduler, plan) -> set[str]:
    return {scheduler.get_request(r).lora for r in plan.num_scheduled_tokens if scheduler.get_request(r).lora}


def test_a_step_holds_at_most_max_loras_adapters_and_the_base_model():
    scheduler, executor = make(max_loras=2)
    for i, lora in enumerate(["a", "b", "c", "", "a", "c", ""]):
        scheduler.add_requests([with_lora(make_request(f"r{i}", [1, 2, 3, i], 6), lora)])
    seen = set()
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        assert len(adapters_of(scheduler, plan)) <= 2
        seen |= adapters_of(scheduler, plan)
        scheduler.update_from_output(plan, executor.execute(plan))
        scheduler.check_integrity()
    assert seen == {"a", "b", "c"}


def test_the_plan_sends_the_adapter_by_name():
    scheduler, _ = make()
    scheduler.add_requests([with_lora(make_request("x", [1, 2, 3], 2), "sql")])
    (new,) = scheduler.schedule().new_requests
    assert new.lora == "sql"


def test_an_adapter_waiting_for_room_is_not_starved_by_busy_ones():
    """Adapters a and b keep receiving requests; c's request, queued behind, still runs: once it is
    first in line without room, a's and b's new requests wait for it."""
    scheduler, executor = make(max_loras=2, max_num_seqs=64)
    counter = 0

    def add(lora):
        nonlocal counter
        counter += 1
        scheduler.add_requests([with_lora(make_request(f"{lora}{counter}", [counter, 1, 2], 3, arrival_time=counter), lora)])

    add("a")
    add("b")
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, executor.execute(plan))
    add("c")
    c_ran_at = None
    for step in range(60):
        add("a")
        add("b")
        plan = scheduler.schedule()
        assert len(adapters_of(scheduler, plan)) <= 2
        if "c" in adapters_of(scheduler, plan) and c_ran_at is None:
            c_ran_at = step
        scheduler.update_from_output(plan, executor.execute(plan))
    assert c_ran_at is not None and c_ran_at <= 6  # its wait: the running requests' length, not the others' load


@pytest.mark.parametrize("max_loras", [0, 1])
def test_no_limit_or_base_requests_only_take_no_detour(max_loras):
    scheduler, executor = make(max_loras=max_loras)
    for i in range(4):
        scheduler.add_requests([make_request(f"r{i}", [1, 2, i], 2)])
    plan = scheduler.schedule()
    assert len(plan.num_scheduled_tokens) == 4


def test_base_and_adapters_never_share_cached_blocks():
    prompt = list(range(1, 18))
    scheduler, executor = make()
    scheduler.add_requests([make_request("base", prompt, 1)])
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, executor.execute(plan))
    manager = scheduler.kv_cache_manager
    base = make_request("probe", prompt, 1)
    assert manager.num_prefix_cached_tokens(prompt, base.prefix_salt) == 16
    adapted = with_lora(make_request("probe", prompt, 1), "a")
    assert manager.num_prefix_cached_tokens(prompt, adapted.prefix_salt) == 0
    scheduler.add_requests([adapted])
    plan = scheduler.schedule()
    assert plan.new_requests[0].num_computed_tokens == 0 and adapted.num_cached_tokens == 0
    # a salt the service makes cannot spell an adapter's
    from scheduler_svc.auth import prefix_cache_salt

    for tenant in ("", "t"):
        spelled = replace(base, cache_salt=prefix_cache_salt(tenant, adapted.prefix_salt))
        assert spelled.prefix_salt != adapted.prefix_salt


def test_max_loras_is_checked():
    with pytest.raises(ValueError, match="max_loras"):
        SchedulerConfig(num_blocks=8, max_loras=-1)


def test_tenants_keep_their_shares_when_their_requests_run_adapters():
    """Tenant x keeps two adapters busy with long requests (every slot it can get); tenant y then sends
    one request of a third adapter and one of the base model. With `max_loras` 2 y's adapter must wait
    for a slot *and* for an adapter's room: its requests still start within a few steps (x's new requests
    of a and b wait behind it, x's running ones over its share are preempted), no step holds more than
    two adapters, and every request ends with its own tokens."""
    scheduler, executor = make(max_loras=2, max_num_seqs=8, budget=64)
    counter = 0

    def add(tenant, lora, max_tokens=12):
        nonlocal counter
        counter += 1
        request = with_lora(make_request(f"{tenant}-{lora or 'base'}-{counter}", [counter % 50 + 1, 7, 9, 11], max_tokens,
                                         arrival_time=counter), lora)
        request.tenant = tenant
        scheduler.add_requests([request])
        return request

    for _ in range(8):
        add("x", "a")
        add("x", "b")
    for _ in range(3):
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, executor.execute(plan))
    assert all(r.tenant == "x" for r in scheduler.running) and len(scheduler.running) == 8
    y_requests = [add("y", "c", max_tokens=4), add("y", "", max_tokens=4)]
    started = {}
    for step in range(40):
        add("x", "a" if step % 2 else "b")
        plan = scheduler.schedule()
        assert len(adapters_of(scheduler, plan)) <= 2
        for request in y_requests:
            if request.req_id in plan.num_scheduled_tokens:
                started.setdefault(request.req_id, step)
        scheduler.update_from_output(plan, executor.execute(plan))
        scheduler.check_integrity()
    assert set(started) == {r.req_id for r in y_requests}, started
    assert max(started.values()) <= 12, started  # bounded by x's running requests' length (12 tokens), not its queue
    assert all(r.is_finished for r in y_requests)
    assert scheduler.num_preemptions > 0  # x was over its share of 4 slots when y came
