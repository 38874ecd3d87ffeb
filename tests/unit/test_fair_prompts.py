"""Tenants take turns at the prompt worker (issue 43, point 2): one tenant's flood of texts to
tokenize does not queue another tenant's prompt behind it (`scheduler_svc.fair_slots`).

Before turns, the worker's threads were first come, first served: the bystander's prompt
below waited for all of the flooder's 60 jobs (about 60 x 30 ms / 2 threads); now it starts
when one of the two running jobs ends.
"""

import asyncio
import time

import pytest

from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.auth import _TENANT
from scheduler_svc.fair_slots import FairSlots
from scheduler_svc.prompts import PromptWorker

FLOOD = 60
JOB_S = 0.03


def slow_job(tag: str) -> str:
    time.sleep(JOB_S)  # (releases the GIL, as the tokenizer's Rust encode does)
    return tag


async def as_tenant(tenant: str, coro_fn):
    _TENANT.set(tenant)  # what the API-key interceptor sets around a handler (a task of its own)
    return await coro_fn()


def test_a_bystanders_prompt_waits_for_one_running_job_not_for_the_flood():
    async def main():
        worker = PromptWorker(tokenizer=None, spec=None, max_model_len=4096)  # threads only: run() needs no tokenizer
        done: list[str] = []

        async def job(tenant, tag):
            done.append(await worker.run(slow_job, tag))

        try:
            flood = [asyncio.create_task(as_tenant("flooder", lambda i=i: job("flooder", f"f{i}"))) for i in range(FLOOD)]
            await asyncio.sleep(JOB_S / 2)  # the flood is queued and two of its jobs run
            t0 = time.monotonic()
            await asyncio.create_task(as_tenant("bystander", lambda: job("bystander", "b")))
            waited = time.monotonic() - t0
            await asyncio.gather(*flood)
        finally:
            worker.close()
        return done.index("b"), waited

    position, waited = asyncio.run(main())
    # First come first served: position 60, ~0.9 s. In turns: after the (at most 2) jobs running, ~0.06 s.
    assert position <= 3, position
    assert waited < FLOOD * JOB_S / 4, waited


def test_one_tenant_alone_uses_every_slot_and_turns_alternate():
    async def main():
        slots = FairSlots(2)
        running, peak, order = 0, 0, []

        async def job(tenant, tag):
            nonlocal running, peak
            async with slots.turn(tenant):
                running += 1
                peak = max(peak, running)
                order.append(tag)
                await asyncio.sleep(0.005)
                running -= 1

        alone = [asyncio.create_task(job("a", f"a{i}")) for i in range(6)]
        await asyncio.gather(*alone)
        assert peak == 2  # work-conserving: no tenant cap when nobody else waits
        order.clear()
        tasks = [asyncio.create_task(job("a", f"a{i}")) for i in range(6)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(job("b", f"b{i}")) for i in range(3)]
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(main())
    # a0, a1 took the free slots; then the tenants alternate while both wait
    assert order[:2] == ["a0", "a1"]
    assert order[2:8] == ["b0", "a2", "b1", "a3", "b2", "a4"], order


def test_a_cancelled_waiter_leaves_the_queue_and_a_cancelled_turn_passes_on():
    async def main():
        slots = FairSlots(1)
        release = asyncio.Event()
        order = []

        async def job(tenant, tag, hold=False):
            async with slots.turn(tenant):
                order.append(tag)
                if hold:
                    await release.wait()

        first = asyncio.create_task(job("a", "a0", hold=True))
        await asyncio.sleep(0)
        cancelled = asyncio.create_task(job("b", "b0"))
        later = asyncio.create_task(job("c", "c0"))
        await asyncio.sleep(0)
        assert slots.num_waiting == 2
        cancelled.cancel()
        await asyncio.sleep(0)
        assert slots.num_waiting == 1
        release.set()
        await asyncio.gather(first, later)
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        # granted, then cancelled before it ran: the slot goes to the next waiter
        hold = asyncio.create_task(job("a", "a1", hold=False))
        release.clear()
        blocker = asyncio.create_task(job("x", "x0", hold=True))
        await asyncio.sleep(0)
        await hold
        granted = asyncio.create_task(job("y", "y0"))
        after = asyncio.create_task(job("z", "z0"))
        await asyncio.sleep(0)
        release.set()
        await asyncio.sleep(0)  # x0 ends: y0's turn is granted
        granted.cancel()
        await asyncio.gather(blocker, after)
        assert slots._busy == 0 and not slots._queues and not slots._holding and not slots._last_turn
        return order

    order = asyncio.run(main())
    assert order == ["a0", "c0", "a1", "x0", "z0"], order
