"""The engine's waiting queue: requests bound to no executor yet, fair across tenants.

Within one tenant, entries go by (priority, arrival): a lower priority value first, then
first come, first served. Across tenants, turns are fair (start-time fair queuing, one
turn per client request): each tenant's head entry has a start tag,

    start(tenant) = max(virtual_time, finish(tenant))      finish(tenant) = start + 1 once bound

and the entry with the smallest start tag is bound next (ties: priority, arrival); the
virtual time is the start tag of the last entry bound. So a tenant that queued a thousand
requests takes every other turn with a tenant that just sent one, whose request is bound
after at most one of the flooder's: it never waits behind the flooder's backlog. A tenant
that was idle starts at the virtual time: no credit is saved up while idle.

With one tenant (API keys off) the start tags grow with arrival, so the order is exactly
(priority, arrival), as before tenants existed. A request that comes back (preempted, or
its executor was lost) keeps its arrival time, so it is its tenant's head again.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from scheduler_svc.core import Request


@dataclass(eq=False)
class QueuedGroup:
    """Requests bound to one executor together (the n samples of a request, or beams)."""

    requests: list[Request]
    tenant: str
    seq: int
    stuck_since: float | None = None  # since when no executor could ever hold it

    @property
    def key(self) -> tuple[int, float, int]:
        first = self.requests[0]
        return (first.priority, first.arrival_time, self.seq)


@dataclass
class WaitingQueue:
    _by_tenant: dict[str, list[QueuedGroup]] = field(default_factory=dict)  # each sorted by key
    _finish: dict[str, int] = field(default_factory=dict)
    _virtual_time: int = 0
    _seq: itertools.count = field(default_factory=itertools.count)

    def push(self, requests: list[Request], tenant: str = "") -> None:
        entry = QueuedGroup(requests, tenant, next(self._seq))
        bisect.insort(self._by_tenant.setdefault(tenant, []), entry, key=lambda e: e.key)

    def in_order(self) -> Iterator[QueuedGroup]:
        """Every entry, the one to bind next first, as if each were bound when yielded.

        A snapshot: `take` and `remove` may be called while iterating.
        """
        lists = {tenant: list(entries) for tenant, entries in self._by_tenant.items() if entries}
        finish, virtual_time = dict(self._finish), self._virtual_time
        heads = [(max(virtual_time, finish.get(t, 0)), entries[0].key, t, 0) for t, entries in lists.items()]
        heapq.heapify(heads)
        while heads:
            start, _, tenant, i = heapq.heappop(heads)
            yield lists[tenant][i]
            virtual_time, finish[tenant] = start, start + 1
            if i + 1 < len(lists[tenant]):
                heapq.heappush(heads, (max(virtual_time, start + 1), lists[tenant][i + 1].key, tenant, i + 1))

    def take(self, entry: QueuedGroup) -> None:
        """`entry` is bound to an executor: its tenant's turn is used."""
        self._by_tenant[entry.tenant].remove(entry)
        start = max(self._virtual_time, self._finish.get(entry.tenant, 0))
        self._virtual_time, self._finish[entry.tenant] = start, start + 1
        self._forget_idle(entry.tenant)

    def remove(self, req_ids: set[str]) -> None:
        """Drop these requests wherever they wait (an aborted or failed client request); no turn is used."""
        for tenant, entries in list(self._by_tenant.items()):
            for entry in entries:
                entry.requests = [r for r in entry.requests if r.req_id not in req_ids]
            self._by_tenant[tenant] = [e for e in entries if e.requests]
            self._forget_idle(tenant)

    def _forget_idle(self, tenant: str) -> None:
        """A tenant with nothing queued and no turn ahead of the virtual time needs no state (bounded memory)."""
        if not self._by_tenant.get(tenant) and self._finish.get(tenant, 0) <= self._virtual_time:
            self._by_tenant.pop(tenant, None)
            self._finish.pop(tenant, None)

    def heads(self) -> dict[str, Request]:
        """Each tenant with requests queued -> the first request of its next entry."""
        return {tenant: entries[0].requests[0] for tenant, entries in self._by_tenant.items() if entries}

    @property
    def entries(self) -> list[QueuedGroup]:
        """Every entry, in no particular order."""
        return [entry for entries in self._by_tenant.values() for entry in entries]

    @property
    def num_requests(self) -> int:
        return sum(len(e.requests) for entries in self._by_tenant.values() for e in entries)
