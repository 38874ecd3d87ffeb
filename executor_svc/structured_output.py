"""Structured output on the executor: one xgrammar matcher per constrained request.

The executor samples every token, so it also keeps each constrained request's grammar
matcher: before a step samples, `bitmask(rows)` fills one row of xgrammar's packed token
bitmask per logits row (bit = 1: the token keeps the output valid), the sampler masks the
logits with it before any other rule, and `accept` advances the matcher with the token
the request got. No bitmask crosses the step protocol and nothing waits on the
scheduler, so async scheduling stays as it is. bench/bench_structured.py measures this
against vLLM's layout, where the scheduler fills the bitmask and ships it with the step: the
fill costs the same either way (1.2 ms for 64 rows here), the wire would carry 384 KiB more
per 64-request step, and the scheduler could not plan a step before the previous step's
tokens are back (async scheduling off: 0.87x the output tokens/s of the W48 load).

A matcher is a function of (constraint, output tokens): a request the executor receives
in full (new, resumed after preemption, or moved here from a dead executor) gets a
matcher that first accepts the output tokens it already has.

Compiled once: a request normally arrives with its grammar as the scheduler's check compiled it
(`NewRequest.compiled_grammar`, xgrammar's serialize_json); a background thread deserializes it
(which validates it; at most `max_grammar_bytes`). Without one (a grammar the scheduler did not
keep), or with one that does not deserialize, the executor compiles it itself.

Loads (deserializing or compiling) run one at a time, tenants in turns (`NewRequest.tenant`):
the tenant that has waited longest since its last turn goes next, so one tenant's queued grammars
delay another's by at most the load running.

Compiling never stalls a step. Grammars compile as soon as the request arrives, off the
step's path, in a child process bounded in time (`timeout_s`) and memory (`memory_bytes`,
`pagoda.grammar_process`), which sends the compiled grammar back serialized; a background
thread deserializes it. A grammar cheaper to compile again than to carry (the child compiled it
in under a second but it is large: 128 tools' calls, 0.35 s to compile, 12 s to serialize and
deserialize) comes back as "compiles" alone, and the background thread compiles it in this
process (xgrammar lets go of the GIL meanwhile: the step goes on), bounded by what the child
measured. A request that reaches its first sample before then (`pending`)
gets no token: the model runner pins `GRAMMAR_PENDING` on it, the step runs the others,
and the scheduler takes it out and binds it again a little later (`defer=False`: the step
waits instead, for tests that drive a runner alone). A compile over a bound fails that
request alone (`GRAMMAR_FAILED`, naming its constraint field). Compiles are shared by content
(`compiled_entries` kept), so a request bound again finds its grammar ready.

Speculative decoding: a request with k drafts has k + 1 rows; row j is the mask after
its drafts d_0..d_{j-1}, so a draft the grammar rejects has probability 0 and is never
accepted; the matcher is rolled back after filling, and advanced by the tokens kept.

Grammar end: the matcher then allows only the tokenizer's stop tokens (EOS), so the
request finishes with EOS. A matcher that is terminated (it accepted EOS) masks
nothing: the scheduler discards the token of a position planned after the end.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from pagoda.constraint import Constraint
from pagoda.grammar_process import CompileProcess, CompileUnavailable

logger = logging.getLogger(__name__)

# xgrammar's compiled-grammar cache of the grammars this process compiles itself (those cheaper to
# compile again than to carry, pagoda.grammar_process), bytes; 128 tools' calls: ~2 MB.
CACHE_LIMIT_BYTES = 256 << 20
COMPILE_THREADS = 1
# The scheduler refused any constraint that did not compile within 10 s in its own check
# (scheduler_svc/constraint_check.py); the executor allows three times that for a slower host.
COMPILE_TIMEOUT_S = 30.0
COMPILE_MEMORY_BYTES = 2 << 30  # above the compile process's footprint after start-up
COMPILED_ENTRIES = 256  # compiled grammars kept by content (a hostile one: ~3.5 MB)
MAX_GRAMMAR_BYTES = 64 << 20  # a serialized grammar the scheduler sends (it sends at most 16 MiB)


class GrammarError(RuntimeError):
    """A request's grammar failed on the executor (it compiled at the scheduler's check)."""


class _CompileFailed(Exception):
    """The compile process's verdict: `str(exc)` is why (over a bound, or xgrammar's reason)."""


class _RequestGrammar:
    """One request's matcher, built once its grammar has compiled; tokens wait until then."""

    __slots__ = ("compiled", "matcher", "pending", "error", "field")

    def __init__(self, compiled: Future, output_token_ids: list[int], field: str = "constraint") -> None:
        self.compiled = compiled
        self.matcher = None
        self.pending = list(output_token_ids)  # accepted before the matcher exists
        self.error: str | None = None
        self.field = field  # the constraint's field, as the scheduler names it (constraint.<kind>)

    def ready(self):
        """The matcher, replaying the tokens so far on first use; raises GrammarError."""
        if self.matcher is None and self.error is None:
            import xgrammar as xgr

            try:
                self.matcher = xgr.GrammarMatcher(self.compiled.result())
            except _CompileFailed as exc:
                self.error = f"its grammar failed to compile on the executor: {exc}"
            except Exception as exc:  # noqa: BLE001 - pinned on this request
                from pagoda.grammars import error_message

                self.error = f"its grammar failed to compile on the executor: {error_message(exc)}"
            else:
                pending, self.pending = self.pending, []
                for token_id in pending:
                    self._accept(token_id)
        if self.error is not None:
            raise GrammarError(self.error)
        return self.matcher

    def accept(self, token_id: int) -> None:
        if self.matcher is None and self.error is None:
            self.pending.append(token_id)
        elif self.matcher is not None:
            self._accept(token_id)

    def _accept(self, token_id: int) -> None:
        if self.matcher.is_terminated():  # a position planned after the end: discarded by the scheduler
            return
        if not self.matcher.accept_token(token_id):
            self.error = f"token {token_id} does not continue its grammar"


class StructuredOutput:
    """The matchers of the executor's constrained requests."""

    def __init__(
        self,
        model_dir: str | Path,
        cache_limit_bytes: int = CACHE_LIMIT_BYTES,
        timeout_s: float = COMPILE_TIMEOUT_S,
        memory_bytes: int = COMPILE_MEMORY_BYTES,
        defer: bool = True,
        compiled_entries: int = COMPILED_ENTRIES,
        max_grammar_bytes: int = MAX_GRAMMAR_BYTES,
    ) -> None:
        self.model_dir = Path(model_dir)
        self._cache_limit_bytes = cache_limit_bytes
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.defer = defer  # a request whose grammar is still compiling: pending (True) or the step waits
        self._info = None
        self._info_lock = threading.Lock()
        self._process: CompileProcess | None = None
        self._threads: ThreadPoolExecutor | None = None
        self._vocab_size = 0
        self._requests: dict[str, _RequestGrammar] = {}
        self._compiled: OrderedDict[str, Future] = OrderedDict()  # constraint key -> its compile
        self._compiled_entries = compiled_entries
        self.num_compiles = 0  # constraints this executor compiled itself
        self.num_received = 0  # grammars it took as the scheduler compiled them
        self._turns_lock = threading.Lock()
        self._queued: dict[str, deque] = {}  # tenant -> its loads waiting for the compile thread
        self._last_turn: dict[str, int] = {}
        self._turns = 0
        self.turn_order: deque[str] = deque(maxlen=64)  # tenants, as their loads started
        self.max_grammar_bytes = max_grammar_bytes
        self._compiler = None  # this process's own, for grammars cheaper to compile again than to carry
        self.num_local_compiles = 0

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._requests

    def __bool__(self) -> bool:
        return bool(self._requests)

    def add(
        self, req_id: str, constraint: Constraint, output_token_ids: list[int], compiled_grammar: bytes = b"", tenant: str = ""
    ) -> None:
        """Start compiling `constraint` for `req_id`, whose output so far is `output_token_ids`:
        deserializing `compiled_grammar` (the scheduler's compile) when given, else compiling it,
        in `tenant`'s turn."""
        if self._threads is None:
            self._threads = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
            self._process = CompileProcess(str(self.model_dir), self.memory_bytes)
            self._process.warm()  # its start-up overlaps this process's tokenizer info
        key = constraint.key
        compiled = self._compiled.get(key)
        if compiled is None or (compiled.done() and compiled.exception() is not None and not isinstance(compiled.exception(), _CompileFailed)):
            compiled = self._compiled[key] = self._in_turn(tenant, self._load, constraint, compiled_grammar)
            while len(self._compiled) > self._compiled_entries:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        self._requests[req_id] = _RequestGrammar(compiled, output_token_ids, constraint.field)

    def _in_turn(self, tenant: str, fn, *args) -> Future:
        """`fn(*args)` on the compile thread, in `tenant`'s turn: each time the thread is free it runs
        the next job of the tenant that has waited longest since its last turn (round robin), so one
        tenant's queued grammars never hold another's first one behind them all."""
        future: Future = Future()
        with self._turns_lock:
            self._queued.setdefault(tenant, deque()).append((future, fn, args))
        self._threads.submit(self._run_next)  # one run per job: each runs whichever job's turn it is
        return future

    def _run_next(self) -> None:
        with self._turns_lock:
            tenant = min(self._queued, key=lambda t: self._last_turn.get(t, -1))
            queue = self._queued[tenant]
            future, fn, args = queue.popleft()
            if not queue:
                del self._queued[tenant]
            self._turns += 1
            self._last_turn[tenant] = self._turns
            for idle in [t for t in self._last_turn if t not in self._queued and t != tenant]:  # bounded:
                del self._last_turn[idle]  # only tenants with a load queued or running (this one)
        self.turn_order.append(tenant)
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - the request's future carries it
            future.set_exception(exc)

    def pending(self, req_id: str) -> bool:
        """Whether `req_id` is constrained and its grammar is still compiling (its matcher not built yet)."""
        grammar = self._requests.get(req_id)
        return grammar is not None and grammar.matcher is None and grammar.error is None and not grammar.compiled.done()

    def field_of(self, req_id: str) -> str:
        grammar = self._requests.get(req_id)
        return grammar.field if grammar is not None else "constraint"

    def remove(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def clear(self) -> None:
        self._requests.clear()

    def accept(self, req_id: str, token_id: int) -> None:
        grammar = self._requests.get(req_id)
        if grammar is not None:
            grammar.accept(token_id)

    def error_of(self, req_id: str) -> str | None:
        """Why `req_id`'s grammar cannot go on (a compile failure, a token it rejected), else None."""
        grammar = self._requests.get(req_id)
        if grammar is None:
            return None
        try:
            grammar.ready()
        except GrammarError as exc:
            return str(exc)
        return None

    def bitmask(self, row_req_ids: list[str], drafts: dict[str, list[int]] | None = None) -> torch.Tensor | None:
        """The packed token bitmask of the logits rows (int32 [rows, ceil(vocab / 32)]); None if no row is constrained.

        `row_req_ids` names each row's request; with `drafts`, a request with k drafts has
        k + 1 consecutive rows (as `ModelRunner.prepare_inputs` lays them out). Rows of
        unconstrained requests allow every token. Raises GrammarError for a request
        whose grammar failed (callers check `error_of` first).
        """
        if not self._requests or not any(r in self._requests for r in row_req_ids):
            return None
        import xgrammar as xgr

        spans, row = [], 0  # (matcher, its drafts, its first row)
        while row < len(row_req_ids):
            req_id = row_req_ids[row]
            draft = drafts.get(req_id, []) if drafts else []
            grammar = self._requests.get(req_id)
            if grammar is not None:
                spans.append((grammar.ready(), draft, row))  # waits for a compile still running
            row += len(draft) + 1
        mask = xgr.allocate_token_bitmask(len(row_req_ids), self._vocab_size)  # every bit set
        for matcher, draft, row in spans:
            self._fill(matcher, draft, mask, row)
        return mask

    @staticmethod
    def _fill(matcher, draft: list[int], mask: torch.Tensor, row: int) -> None:
        """Rows `row .. row + len(draft)`: the mask before each draft token; the matcher is left as it was."""
        num_accepted = 0
        for j in range(len(draft) + 1):
            if matcher.is_terminated():
                break  # the rest of the rows stay all-allowed: their tokens are past the end
            matcher.fill_next_token_bitmask(mask, row + j)
            if j == len(draft) or not matcher.accept_token(draft[j]):
                break  # a rejected draft has probability 0 in row j: later rows are never used
            num_accepted += 1
        if num_accepted:
            matcher.rollback(num_accepted)

    def _load(self, constraint: Constraint, compiled_grammar: bytes):
        """In the compile thread: the scheduler's compiled grammar if it deserializes, else our own compile."""
        if compiled_grammar:
            import xgrammar as xgr

            info = self._tokenizer_info()
            try:
                if len(compiled_grammar) > self.max_grammar_bytes:
                    raise ValueError(f"{len(compiled_grammar)} bytes, over {self.max_grammar_bytes}")
                grammar = xgr.CompiledGrammar.deserialize_json(compiled_grammar.decode(), info)
            except Exception as exc:  # noqa: BLE001 - any flaw: compile it here instead
                logger.warning("the scheduler's compiled grammar for %s did not load (%s): compiling it here", constraint.field, exc)
            else:
                self.num_received += 1
                return grammar
        return self._compile(constraint)

    def _compile(self, constraint: Constraint):
        """In the compile thread: the compile process's grammar, deserialized here; raises _CompileFailed."""
        import xgrammar as xgr

        info = self._tokenizer_info()
        if self._process is None:
            self._process = CompileProcess(str(self.model_dir), self.memory_bytes)
        self.num_compiles += 1
        try:
            error, data = self._process.compile(constraint, self.timeout_s, serialize=True)
        except CompileUnavailable as exc:
            raise RuntimeError(str(exc)) from None  # not cached: the next request of it tries again
        if error is not None:
            raise _CompileFailed(error.removeprefix("does not compile: "))
        if data is None:  # it compiled within the child's bounds, and compiling it again is cheaper than carrying it
            from pagoda.grammars import compile_constraint

            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=self._cache_limit_bytes)
            self.num_local_compiles += 1
            return compile_constraint(self._compiler, constraint)
        return xgr.CompiledGrammar.deserialize_json(data.decode(), info)

    def _tokenizer_info(self):
        with self._info_lock:
            if self._info is None:
                from pagoda.grammars import tokenizer_info

                self._info = tokenizer_info(self.model_dir)
                self._vocab_size = self._info.vocab_size
                logger.info("grammar tokenizer info ready for %s (vocabulary %d)", self.model_dir, self._vocab_size)
            return self._info

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        if self._process is not None:
            self._process.stop()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits whose bit is 0 (xgrammar's kernel for the logits' device)."""
    import xgrammar as xgr

    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        return
    if logits.device.type == "cuda":
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
        return
    # any other layout: unpack the bits with torch ops
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.to(logits.device).unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
    logits.masked_fill_(~allowed, -float("inf"))
