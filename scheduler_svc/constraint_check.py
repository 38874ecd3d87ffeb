"""Does a request's constraint compile? Checked before any work, off the event loop, bounded.

A schema, regex or grammar that does not parse or compile is refused with INVALID_ARGUMENT
naming `constraint.<kind>` and xgrammar's reason. Compiling runs in a child process
(`CompileProcess`, started on first use: it imports xgrammar and builds the tokenizer's
`TokenizerInfo` once, a few seconds), never in the scheduler's own process:

* bounded in time: a compile that takes longer than `timeout_s` is killed with its process
  (the next one starts a fresh child) and the constraint refused, so a pathological regex
  costs one child at most `timeout_s` and never the event loop;
* bounded in memory: the child's address space is capped at what it uses after start-up
  plus `memory_bytes`; a compile that needs more fails there (refused), not in the scheduler;
* cached by content (`Constraint.key`, LRU of `cache_entries` verdicts, refusals included),
  and concurrent checks of one constraint share one compile.

(The child is `pagoda.grammar_process.CompileProcess`, which the executors use too.)

At most `num_processes` compiles run at once, shared fairly across tenants: each tenant's
compiles wait in its own queue, the queues take turns (round robin), and a tenant runs at
most `num_processes - 1` compiles at once (at least one), so a tenant's first constraint never
waits behind another tenant's queued ones, nor, with two processes or more, behind its running
ones. A tenant with `max_pending_per_tenant` compiles queued or running, or a checker with
`max_pending`, gets RESOURCE_EXHAUSTED. The child and its parent exchange JSON over a pipe
(nothing pickled).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter, OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagoda.constraint import Constraint
from pagoda.grammar_process import CompileProcess, CompileUnavailable
from scheduler_svc.errors import InvalidArgument, ResourceExhausted, Unavailable

log = logging.getLogger(__name__)

# Measured on the 2-core test machine: the default model's JSON schemas of a few fields
# compile in 20-60 ms, a 30-field schema with patterns in 0.8 s; ten seconds is generous
# for any legitimate grammar and bounds what a pathological one costs.
COMPILE_TIMEOUT_S = 10.0
# Above the child's own footprint after start-up (the tokenizer info is ~100 MB).
COMPILE_MEMORY_BYTES = 2 << 30
CACHE_ENTRIES = 4096
NUM_PROCESSES = 2  # one tenant's slow compile never holds up another tenant's
MAX_PENDING = 256
MAX_PENDING_PER_TENANT = 8
# Compiled grammars kept to send with requests (serialized). Measured with the default model: a
# one-field schema 7 KB; 24 fields 6.3 MB (compiled in 0.91 s, serialized in 0.38 s, deserialized
# in 0.17 s; the plan carrying it serializes in 8.5 ms and parses in 5 ms); 8 strings of maxLength
# 1000, 15.7 MB (2.94 s, 0.88 s, 0.47 s; 21 ms and 17 ms). Over this the executor compiles it.
MAX_SENT_GRAMMAR_BYTES = 16 << 20
GRAMMAR_CACHE_BYTES = 256 << 20


class ConstraintChecker:
    """`await check(constraint)`: returns when it compiles, else raises InvalidArgument naming it.

    What it returns is the compiled grammar, serialized (xgrammar's `serialize_json`), for the
    request to carry to its executor (`SamplingParams.compiled_grammar`, `NewRequest.compiled_grammar`),
    so the constraint is compiled once: b"" when not kept (over `max_sent_bytes`, or evicted from the
    `cache_bytes` of grammars kept since), and then the executor compiles it itself, bounded as here.
    """

    def __init__(
        self,
        model_dir: str | Path,
        timeout_s: float = COMPILE_TIMEOUT_S,
        memory_bytes: int = COMPILE_MEMORY_BYTES,
        num_processes: int = NUM_PROCESSES,
        cache_entries: int = CACHE_ENTRIES,
        max_pending: int = MAX_PENDING,
        max_pending_per_tenant: int = MAX_PENDING_PER_TENANT,
        max_sent_bytes: int = MAX_SENT_GRAMMAR_BYTES,
        cache_bytes: int = GRAMMAR_CACHE_BYTES,
    ) -> None:
        self.timeout_s = timeout_s
        self._grammars: OrderedDict[str, bytes] = OrderedDict()  # key -> its compiled grammar, serialized
        self._grammar_bytes = 0
        self._max_sent_bytes = max_sent_bytes
        self._cache_bytes = cache_bytes
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()  # key -> None (compiles) or why not
        self._cache_entries = cache_entries
        self._in_flight: dict[str, asyncio.Future] = {}
        self._max_pending = max_pending
        self._processes = [CompileProcess(str(model_dir), memory_bytes) for _ in range(num_processes)]
        self._free: list[CompileProcess] = list(self._processes)
        self._free_lock = threading.Lock()
        self._threads = ThreadPoolExecutor(num_processes, thread_name_prefix="constraint-check")
        self.num_compiles = 0  # constraints sent to a compile process (cache misses)
        self._max_pending_per_tenant = max_pending_per_tenant
        self._max_running_per_tenant = max(1, num_processes - 1)
        self._queues: dict[str, deque[tuple[Constraint, asyncio.Future]]] = {}  # tenant -> its compiles waiting
        self._pending_of: Counter[str] = Counter()  # tenant -> its compiles queued or running
        self._running_of: Counter[str] = Counter()
        self._num_running = 0
        self._turns = 0
        self._warmed = False
        self._last_turn: dict[str, int] = {}  # tenant with compiles queued or running -> its last turn
        self.compile_order: deque[tuple[str, str]] = deque(maxlen=64)  # (tenant, key) as compiles started

    async def check(self, constraint: Constraint, tenant: str = "") -> bytes:
        """Its compiled grammar (b"": not kept) when `constraint` compiles, else raises InvalidArgument
        naming it; `tenant` takes its turn."""
        key = constraint.key
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            verdict = self._verdicts[key]
        else:
            future = self._in_flight.get(key)
            if future is None:
                if len(self._in_flight) >= self._max_pending:
                    raise ResourceExhausted(f"{len(self._in_flight)} constraints are being compiled; retry later")
                if self._pending_of[tenant] >= self._max_pending_per_tenant:
                    raise ResourceExhausted(
                        f"this tenant has {self._pending_of[tenant]} constraints being compiled, its share; "
                        "retry when one is done"
                    )
                future = self._in_flight[key] = asyncio.get_running_loop().create_future()
                self._pending_of[tenant] += 1
                self._queues.setdefault(tenant, deque()).append((constraint, future))
                self._pump()
            verdict = await asyncio.shield(future)
        if verdict is not None:
            raise InvalidArgument(constraint.field, verdict)
        grammar = self._grammars.get(key)
        if grammar is None:
            return b""
        self._grammars.move_to_end(key)
        return grammar

    def _pump(self) -> None:
        """Start queued compiles while a process is free: tenants in turn, each within its running cap."""
        if not self._warmed:  # every process starts with the first check: the second tenant's is ready
            self._warmed = True
            for process in self._processes[:-1]:  # (the last is the first one taken, started by its compile)
                process.warm()
        while self._num_running < len(self._processes):
            ready = [t for t, q in self._queues.items() if q and self._running_of[t] < self._max_running_per_tenant]
            if not ready:
                return
            tenant = min(ready, key=lambda t: self._last_turn.get(t, -1))  # the longest since its last turn
            self._turns += 1
            self._last_turn[tenant] = self._turns
            queue = self._queues[tenant]
            constraint, future = queue.popleft()
            if not queue:
                del self._queues[tenant]
            self._num_running += 1
            self._running_of[tenant] += 1
            self.num_compiles += 1
            self.compile_order.append((tenant, constraint.key))
            done = asyncio.get_running_loop().run_in_executor(self._threads, self._compile_blocking, constraint)
            done.add_done_callback(lambda d, t=tenant, c=constraint, f=future: self._compiled(t, c, f, d))

    def _compiled(self, tenant: str, constraint: Constraint, future: asyncio.Future, done: asyncio.Future) -> None:
        self._num_running -= 1
        for counter in (self._running_of, self._pending_of):
            counter[tenant] -= 1
            if counter[tenant] <= 0:
                del counter[tenant]
        if tenant not in self._pending_of:
            self._last_turn.pop(tenant, None)  # bounded state: only tenants with compiles
        self._in_flight.pop(constraint.key, None)
        if done.cancelled() or done.exception() is not None:
            exc = done.exception() if not done.cancelled() else Unavailable("the constraint check was cancelled; retry")
            if not future.done():
                future.set_exception(exc)
        else:
            verdict, grammar = done.result()
            if verdict is None and grammar:
                self._keep(constraint.key, grammar)
            self._verdicts[constraint.key] = verdict
            while len(self._verdicts) > self._cache_entries:
                self._verdicts.popitem(last=False)
            if not future.done():
                future.set_result(verdict)
        self._pump()

    def _keep(self, key: str, grammar: bytes) -> None:
        if len(grammar) > self._max_sent_bytes:
            return
        self._grammars[key] = grammar
        self._grammar_bytes += len(grammar)
        while self._grammar_bytes > self._cache_bytes:
            self._grammar_bytes -= len(self._grammars.popitem(last=False)[1])

    def _compile_blocking(self, constraint: Constraint) -> tuple[str | None, bytes | None]:
        with self._free_lock:
            process = self._free.pop()
        try:
            return process.compile(constraint, self.timeout_s, serialize=True)
        except CompileUnavailable as exc:
            raise Unavailable(str(exc)) from None
        finally:
            with self._free_lock:
                self._free.append(process)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        for process in self._processes:
            process.stop()


