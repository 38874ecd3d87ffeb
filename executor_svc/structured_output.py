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
matcher that first accepts the output tokens it already has. Grammars compile in a
background thread as soon as the request arrives (xgrammar releases the GIL while it
compiles), during its prefill; `bitmask` waits for the compile only if it is still
running when the request first samples. Compiled grammars are cached by content by
xgrammar's compiler, bounded by `cache_limit_bytes`.

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
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from pagoda.constraint import Constraint

logger = logging.getLogger(__name__)

# xgrammar's compiled-grammar cache (bytes); a JSON schema of a few fields is ~50 KB here.
CACHE_LIMIT_BYTES = 256 << 20
COMPILE_THREADS = 1


class GrammarError(RuntimeError):
    """A request's grammar failed on the executor (it compiled at the scheduler's check)."""


class _RequestGrammar:
    """One request's matcher, built once its grammar has compiled; tokens wait until then."""

    __slots__ = ("compiled", "matcher", "pending", "error")

    def __init__(self, compiled: Future, output_token_ids: list[int]) -> None:
        self.compiled = compiled
        self.matcher = None
        self.pending = list(output_token_ids)  # accepted before the matcher exists
        self.error: str | None = None

    def ready(self):
        """The matcher, replaying the tokens so far on first use; raises GrammarError."""
        if self.matcher is None and self.error is None:
            import xgrammar as xgr

            try:
                self.matcher = xgr.GrammarMatcher(self.compiled.result())
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

    def __init__(self, model_dir: str | Path, cache_limit_bytes: int = CACHE_LIMIT_BYTES) -> None:
        self.model_dir = Path(model_dir)
        self._cache_limit_bytes = cache_limit_bytes
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._threads: ThreadPoolExecutor | None = None
        self._vocab_size = 0
        self._requests: dict[str, _RequestGrammar] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._requests

    def __bool__(self) -> bool:
        return bool(self._requests)

    def add(self, req_id: str, constraint: Constraint, output_token_ids: list[int]) -> None:
        """Start compiling `constraint` for `req_id`, whose output so far is `output_token_ids`."""
        if self._threads is None:
            self._threads = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._requests[req_id] = _RequestGrammar(self._threads.submit(self._compile, constraint), output_token_ids)

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

    def _compile(self, constraint: Constraint):
        from pagoda.grammars import compile_constraint

        return compile_constraint(self._compiler_or_build(), constraint)

    def _compiler_or_build(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                from pagoda.grammars import tokenizer_info

                info = tokenizer_info(self.model_dir)
                self._vocab_size = info.vocab_size
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=self._cache_limit_bytes)
                logger.info("grammar compiler ready for %s (vocabulary %d)", self.model_dir, info.vocab_size)
            return self._compiler


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
