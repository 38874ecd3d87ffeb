"""Turns across tenants for a worker pool in front of the engine (issue 43, point 2).

A thread pool's queue is first come, first served: a tenant that sends a thousand texts to
tokenize puts every later caller behind all of them, so another tenant's first token would
wait in proportion to the flood. `FairSlots` sits in front of such a pool: at most `slots`
jobs run at once (the pool's size), and when a slot frees, the waiting job that starts is the
first of the tenant that has waited longest since its last turn (round robin; first come,
first served within a tenant). It is work-conserving: one tenant alone uses every slot. So a
newcomer's job waits for at most one running job to end, however many another tenant queued.

    slots = FairSlots(2)
    async with slots.turn(current_tenant()):
        await loop.run_in_executor(pool, fn)

A waiter that is cancelled (its client went away) leaves the queue; one cancelled just as
its turn came passes the slot on. State is kept only for tenants with jobs queued or running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, deque


class FairSlots:
    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"FairSlots needs at least one slot, got {slots}")
        self.slots = slots
        self._busy = 0
        self._queues: dict[str, deque[asyncio.Future]] = {}  # tenant -> its waiters, oldest first
        self._holding: Counter[str] = Counter()  # tenant -> slots it holds
        self._last_turn: dict[str, int] = {}  # tenant with jobs queued or running -> its last turn
        self._turns = 0

    @contextlib.asynccontextmanager
    async def turn(self, tenant: str = ""):
        """Hold one slot for the body, taken in `tenant`'s turn."""
        await self._acquire(tenant)
        try:
            yield
        finally:
            self._release(tenant)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    async def _acquire(self, tenant: str) -> None:
        if self._busy < self.slots and not self._queues:
            self._take(tenant)
            return
        waiter = asyncio.get_running_loop().create_future()
        self._queues.setdefault(tenant, deque()).append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # its turn came as it was cancelled: pass it on
                self._release(tenant)
            else:
                queue = self._queues.get(tenant)
                if queue is not None and waiter in queue:
                    queue.remove(waiter)
                    if not queue:
                        del self._queues[tenant]
                self._forget(tenant)
            raise

    def _take(self, tenant: str) -> None:
        self._busy += 1
        self._holding[tenant] += 1
        self._turns += 1
        self._last_turn[tenant] = self._turns

    def _release(self, tenant: str) -> None:
        self._busy -= 1
        self._holding[tenant] -= 1
        if self._holding[tenant] <= 0:
            del self._holding[tenant]
        self._forget(tenant)
        self._grant()

    def _forget(self, tenant: str) -> None:
        if tenant not in self._holding and tenant not in self._queues:
            self._last_turn.pop(tenant, None)

    def _grant(self) -> None:
        while self._busy < self.slots and self._queues:
            tenant = min(self._queues, key=lambda t: self._last_turn.get(t, -1))  # longest since its turn
            queue = self._queues[tenant]
            waiter = queue.popleft()
            if not queue:
                del self._queues[tenant]
            if waiter.done():  # cancelled while queued
                self._forget(tenant)
                continue
            self._take(tenant)
            waiter.set_result(None)
