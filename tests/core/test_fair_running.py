"""Fair running slots between tenants (issue 43, point 2): one tenant cannot hold every slot.

A flooder fills every running slot of one executor with long requests; a bystander's request
(bound here, or still waiting in the engine's queue) gets a slot and its first token within two
steps, the flooder's newest requests are preempted to make the room and lose nothing (their
tokens equal a run where nobody else came), and alone a tenant still uses every slot.
"""

from scheduler_svc.core import Scheduler, SchedulerConfig

from .fake_executor import FakeExecutor, make_request, run_to_completion, step

MAX_NUM_SEQS = 8


def make(max_num_seqs=MAX_NUM_SEQS, budget=64, num_blocks=600, **kwargs):
    config = SchedulerConfig(
        num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
        max_model_len=512, **kwargs,
    )
    return Scheduler(config), FakeExecutor(4, num_blocks)


def request(req_id, tenant, prompt=(1, 2, 3), max_tokens=200, arrival_time=0.0):
    r = make_request(req_id, list(prompt), max_tokens, arrival_time=arrival_time)
    r.tenant = tenant
    return r


def flood(scheduler, executor, n=MAX_NUM_SEQS):
    flooders = [request(f"f{i}", "flooder", prompt=(5, i, 7), arrival_time=float(i)) for i in range(n)]
    for r in flooders:
        scheduler.add_requests([r])
    for _ in range(3):
        step(scheduler, executor)
    assert scheduler.num_running == n
    return flooders


def first_token_steps(scheduler, executor, req_id, max_steps=50):
    for i in range(1, max_steps + 1):
        if any(u.req_id == req_id for u in step(scheduler, executor)):
            return i
    raise AssertionError(f"{req_id} got no token in {max_steps} steps")


def test_a_bystander_bound_here_gets_a_slot_within_two_steps_and_the_flooder_loses_nothing():
    scheduler, executor = make()
    flooders = flood(scheduler, executor)
    bystander = request("b", "bystander", prompt=(9, 9, 9), max_tokens=4, arrival_time=100.0)
    scheduler.add_requests([bystander])
    assert first_token_steps(scheduler, executor, "b") <= 2
    assert scheduler.num_preemptions >= 1
    # held to its share while the bystander has work
    assert sum(r.tenant == "flooder" for r in scheduler.running) <= MAX_NUM_SEQS - 1
    run_to_completion(scheduler, executor)
    scheduler.check_integrity()
    # nothing lost: each flooder's tokens equal a run with nobody else
    alone, alone_executor = make()
    replay = [request(f"f{i}", "flooder", prompt=(5, i, 7), arrival_time=float(i)) for i in range(MAX_NUM_SEQS)]
    for r in replay:
        alone.add_requests([r])
    run_to_completion(alone, alone_executor)
    assert alone.num_preemptions == 0
    assert [r.output_token_ids for r in flooders] == [r.output_token_ids for r in replay]
    assert all(len(r.output_token_ids) == 200 for r in flooders)


def test_a_bystander_in_the_engines_queue_gets_room_and_the_flooder_is_held_back():
    scheduler, executor = make()
    flood(scheduler, executor)
    bystander = request("b", "bystander", arrival_time=100.0)
    newcomer = request("f-new", "flooder", arrival_time=50.0)
    assert not scheduler.can_admit([bystander])  # every slot is the flooder's
    scheduler.set_waiting_elsewhere({"bystander": bystander, "flooder": newcomer})
    assert scheduler.holds_back("flooder") and not scheduler.holds_back("bystander")
    plan = scheduler.schedule()  # makes room: the flooder's newest request is preempted
    assert plan.finished_req_ids == ["f7"]
    scheduler.update_from_output(plan, executor.execute(plan))
    moved = scheduler.take_movable()  # back to the engine's queue with its tokens
    assert [r.req_id for r in moved] == ["f7"] and moved[0].output_token_ids
    assert scheduler.can_admit([bystander]) and not scheduler.can_admit([newcomer])
    scheduler.set_waiting_elsewhere({"flooder": moved[0]})
    scheduler.add_requests([bystander])
    assert first_token_steps(scheduler, executor, "b") == 1
    # the bystander runs; the flooder may take the free slots again only while nobody else waits
    scheduler.set_waiting_elsewhere({})
    assert scheduler.can_admit([newcomer]) is False  # 8 running: full, no fairness needed for that


def test_one_tenant_alone_uses_every_slot_and_is_never_preempted_for_fairness():
    scheduler, executor = make()
    flood(scheduler, executor)
    for _ in range(5):
        step(scheduler, executor)
    assert scheduler.num_running == MAX_NUM_SEQS and scheduler.num_preemptions == 0


def test_max_running_per_tenant_caps_the_flooder_while_another_tenant_waits():
    scheduler, executor = make(max_running_per_tenant=2)
    flooders = [request(f"f{i}", "flooder", arrival_time=float(i)) for i in range(6)]
    for r in flooders:
        scheduler.add_requests([r])
    scheduler.add_requests([request("b", "bystander", arrival_time=0.5, max_tokens=100)])
    step(scheduler, executor)
    running = [r.tenant for r in scheduler.running]
    assert running.count("flooder") == 2 and running.count("bystander") == 1


def test_a_tenants_prefill_gets_at_most_its_share_of_the_step_budget():
    scheduler, executor = make(budget=64)
    scheduler.add_requests([request("long", "flooder", prompt=range(1, 300), arrival_time=0.0)])
    step(scheduler, executor)  # alone: the whole budget
    assert scheduler.get_request("long").num_computed_tokens == 64
    scheduler.add_requests([request("b", "bystander", prompt=range(1, 100), arrival_time=1.0)])
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"long": 32, "b": 32}
    scheduler.update_from_output(plan, executor.execute(plan))
    run_to_completion(scheduler, executor)


def test_short_of_blocks_the_victim_is_the_heaviest_tenants_newest_not_the_bystander():
    """KV pressure preempts the newest request of the tenant furthest over its share, not the
    newest arrival (the bystander would be preempted again and again)."""
    scheduler, executor = make(num_blocks=41, budget=64)  # 40 blocks of 4 tokens
    flooders = [request(f"f{i}", "flooder", prompt=(5, i, 7), arrival_time=float(i)) for i in range(6)]
    for r in flooders:
        scheduler.add_requests([r])
    bystander = request("b", "bystander", prompt=(9, 9, 9), max_tokens=60, arrival_time=100.0)
    scheduler.add_requests([bystander])
    for _ in range(60):
        step(scheduler, executor)
        if bystander.is_finished:
            break
    assert bystander.num_preemptions == 0 and len(bystander.output_token_ids) == 60
    assert scheduler.num_preemptions > 0  # the flooder's requests paid for the blocks
