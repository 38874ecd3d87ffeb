"""The engine's waiting queue (issue #24): fair turns across tenants, (priority, arrival) within one."""

from __future__ import annotations

from scheduler_svc.core import Request
from scheduler_svc.waiting_queue import WaitingQueue


def _push(queue: WaitingQueue, tenant: str, name: str, priority: int = 0, arrival: float = 0.0) -> None:
    queue.push([Request(name, [1, 2, 3], priority=priority, arrival_time=arrival)], tenant)


def _order(queue: WaitingQueue) -> list[str]:
    return [entry.requests[0].req_id for entry in queue.in_order()]


def _bind_next(queue: WaitingQueue, n: int) -> list[str]:
    taken = []
    for _ in range(n):
        entry = next(queue.in_order())
        queue.take(entry)
        taken.append(entry.requests[0].req_id)
    return taken


def test_one_tenant_is_served_by_priority_then_arrival():
    queue = WaitingQueue()
    for i, priority in enumerate([0, 1, -1, 0]):
        _push(queue, "", f"r{i}", priority, arrival=float(i))
    assert _order(queue) == ["r2", "r0", "r3", "r1"]
    assert _bind_next(queue, 4) == ["r2", "r0", "r3", "r1"]
    assert queue.num_requests == 0


def test_a_tenant_that_sent_one_request_never_waits_behind_a_flooders_backlog():
    queue = WaitingQueue()
    for i in range(100):
        _push(queue, "flooder", f"f{i}", arrival=float(i))
    assert _bind_next(queue, 10) == [f"f{i}" for i in range(10)]
    _push(queue, "bystander", "b0", arrival=200.0)
    _push(queue, "bystander", "b1", arrival=201.0)
    assert _order(queue)[:4] == ["b0", "f10", "b1", "f11"]  # turns alternate from now on
    assert _bind_next(queue, 4) == ["b0", "f10", "b1", "f11"]


def test_priority_orders_a_tenants_own_requests_not_its_turns():
    queue = WaitingQueue()
    for i in range(3):
        _push(queue, "a", f"a{i}", priority=-100, arrival=float(i))
    _push(queue, "b", "b0", priority=0, arrival=10.0)
    _push(queue, "a", "a-urgent", priority=-1000, arrival=11.0)
    assert _order(queue) == ["a-urgent", "b0", "a0", "a1", "a2"]


def test_an_idle_tenant_saves_up_no_turns_and_removal_uses_none():
    queue = WaitingQueue()
    _push(queue, "a", "a0")
    assert _bind_next(queue, 1) == ["a0"]
    for i in range(1, 4):
        _push(queue, "b", f"b{i}", arrival=float(i))
    assert _bind_next(queue, 3) == ["b1", "b2", "b3"]
    for i in range(1, 4):
        _push(queue, "a", f"a{i}", arrival=10.0 + i)
        _push(queue, "b", f"b{i + 3}", arrival=10.5 + i)
    queue.remove({"a1"})
    assert _order(queue) == ["a2", "b4", "a3", "b5", "b6"]
    assert queue.num_requests == 5 and len(queue.entries) == 5
