"""Beam search over core requests, step for step as transformers' `generate(num_beams=W)`.

Every live beam is one core `Request` (`is_beam`) that lives for one token: the executor
computes its next position and returns, beside its own greedy pick, the
`num_candidates` best (token, raw logprob) pairs. Once every live beam of the current
generation has reported, `BeamSearch` does what transformers' `_beam_search` does::

    candidates  (beam score + logprob) over every live beam, best first
    finished    those of the best W that end -- a stop token, or max_tokens reached --
                join the hypotheses, scored score / num_tokens ** length_penalty;
                the W best hypotheses are kept
    running     the best W that do not end are generation g + 1: each chosen parent is
                forked into its children (`Scheduler.fork_beams`: blocks shared, the
                partial block copied); a parent nobody chose is finished
    stop        at max_tokens, or once W hypotheses exist and the best running beam,
                scored as if it ended now, cannot beat the worst of them
                (transformers' heuristic for `early_stopping=False`)

Per beam, the best W + len(stop tokens) candidates are enough: they hold its best W
candidates that do not end, and every candidate of it among the global best W.

Scores are sums of raw log-probabilities (log_softmax of the logits, nothing else
applied), except that stop tokens are no candidates while fewer than `min_tokens`
tokens are out (transformers' `min_new_tokens`). Pure Python: the engine, or a test,
applies each `BeamStep` to a core scheduler (`apply_beam_step`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pagoda.step import SampledToken, SamplingParams
from scheduler_svc.core import FinishReason, Request, Scheduler


@dataclass(frozen=True)
class BeamSearchParams:
    """One beam search: `n` best sequences of at most `max_tokens` tokens out of `beam_width` beams.

    `stop_token_ids` end a hypothesis (the EOS ids among them give FinishReason.EOS);
    `top_logprobs` is what the client asked to see per token, not what the search needs.
    `length_penalty` and `early_stopping` are transformers' (defaults: 1.0 and False).
    """

    beam_width: int
    max_tokens: int
    n: int = 1
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as transformers
    vocab_size: int = 0  # 0 = unknown; bounds num_candidates

    def __post_init__(self) -> None:
        if not 1 <= self.n <= self.beam_width:
            raise ValueError(f"n must be in [1, beam_width {self.beam_width}], got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")

    @property
    def num_candidates(self) -> int:
        """Top logprobs each beam asks its executor for: never more than the vocabulary has.

        With every token a candidate the search is still exact (see the module docstring).
        """
        wanted = max(self.beam_width + len(self.stop_token_ids), self.top_logprobs)
        return min(wanted, self.vocab_size) if self.vocab_size else wanted


@dataclass(frozen=True)
class Hypothesis:
    """A finished sequence: its output tokens, its length-normalized score and why it ended."""

    output_token_ids: tuple[int, ...]
    score: float
    finish_reason: FinishReason
    logprobs: tuple[SampledToken, ...] = ()  # per token, when asked


@dataclass
class _Beam:
    req_id: str
    output_token_ids: list[int]
    score: float  # sum of the raw logprobs of output_token_ids
    logprobs: tuple[SampledToken, ...] = ()
    candidates: list[tuple[int, float]] | None = None  # reported for the current generation


class _Candidate(NamedTuple):
    score: float
    beam: _Beam
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


class BeamStep(NamedTuple):
    """What the core must do after a generation: finish these beams, fork those parents.

    Apply in this order (`apply_beam_step`): finishing first frees the blocks the forks may need.
    """

    finished_req_ids: list[str]
    forks: list[tuple[str, list[Request]]]  # (parent req_id, its children), best child first
    done: bool


@dataclass
class BeamSearch:
    """The beams of one client request; generation g = every live beam has g output tokens.

    `root()` is generation 0; feed every live beam's sampled token to `on_sampled`; the
    generation's `BeamStep` comes back with the last one. Once `done`, `best()` is the
    answer. Request ids are `beam<k>:<request_id>`, never reused.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: BeamSearchParams
    priority: int = 0
    cache_salt: str = ""
    tenant: str = ""  # who sent it: every beam counts against its tenant's share of running slots
    lora: str = ""  # the LoRA adapter every beam runs with
    images: tuple = ()  # a chat's images (pagoda.step.ImageInput): every beam's request carries them
    arrival_time: float = 0.0
    generation: int = field(default=0, init=False)
    done: bool = field(default=False, init=False)
    hypotheses: list[Hypothesis] = field(default_factory=list, init=False)  # best first, at most beam_width
    _beams: list[_Beam] = field(default_factory=list, init=False, repr=False)  # live, best first
    _improvable: bool = field(default=True, init=False)  # transformers' is_early_stop_heuristic_unsatisfied
    _ids: itertools.count = field(default_factory=itertools.count, init=False, repr=False)

    def __post_init__(self) -> None:
        self._beams = [_Beam(self._new_id(), [], 0.0)]

    # ---- the beams as core requests -------------------------------------------------------

    def root(self) -> Request:
        """Generation 0: the prompt alone."""
        (beam,) = self._beams
        return self._request(beam)

    @property
    def live_req_ids(self) -> list[str]:
        return [beam.req_id for beam in self._beams]

    def restart(self) -> list[Request]:
        """Fresh requests for the live beams (their executor is gone); reported candidates are dropped."""
        for beam in self._beams:
            beam.req_id, beam.candidates = self._new_id(), None
        return [self._request(beam) for beam in self._beams]

    def _new_id(self) -> str:
        return f"beam{next(self._ids)}:{self.request_id}"

    def _request(self, beam: _Beam) -> Request:
        return Request(
            req_id=beam.req_id,
            prompt_token_ids=list(self.prompt_token_ids),
            output_token_ids=list(beam.output_token_ids),
            sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=self.params.num_candidates),
            max_tokens=self.params.max_tokens,
            eos_token_ids=self.params.eos_token_ids,
            priority=self.priority,
            arrival_time=self.arrival_time,
            is_beam=True,
            cache_salt=self.cache_salt,
            tenant=self.tenant,
            lora=self.lora,
            images=self.images,
        )

    # ---- one generation -------------------------------------------------------------------

    def on_sampled(self, sampled: SampledToken) -> BeamStep | None:
        """Record a live beam's candidates; the generation's step once every live beam has reported."""
        if self.done:
            raise ValueError(f"beam search {self.request_id!r} is done")
        beam = next((b for b in self._beams if b.req_id == sampled.req_id), None)
        if beam is None:
            raise ValueError(f"{sampled.req_id!r} is not a live beam of {self.request_id!r}")
        if not sampled.top_logprobs:
            raise ValueError(f"beam {sampled.req_id!r} reported no candidates (its top_logprobs is empty)")
        beam.candidates = list(sampled.top_logprobs)
        if any(b.candidates is None for b in self._beams):
            return None
        return self._advance()

    def _advance(self) -> BeamStep:
        params, width = self.params, self.params.beam_width
        num_tokens = self.generation + 1  # output tokens of every candidate
        candidates = sorted(self._candidates(), key=lambda c: -c.score)
        ends = [c.token_id in params.stop_token_ids or num_tokens >= params.max_tokens for c in candidates]
        if self._improvable and not (len(self.hypotheses) == width and params.early_stopping is True):
            new = [self._hypothesis(c, num_tokens) for c, end in zip(candidates[:width], ends) if end]
            self.hypotheses = sorted(self.hypotheses + new, key=lambda h: -h.score)[:width]
        running = [c for c, end in zip(candidates, ends) if not end][:width]
        self.generation = num_tokens
        self._update_improvable(running)
        full = len(self.hypotheses) == width
        self.done = not running or not self._improvable or (full and params.early_stopping is True)
        if self.done:
            finished = self.live_req_ids
            self._beams = []
            return BeamStep(finished, [], True)
        return self._fork(running)

    def _candidates(self) -> list[_Candidate]:
        mask_stop = self.generation < self.params.min_tokens
        out = []
        for beam in self._beams:
            assert beam.candidates is not None
            for token_id, logprob in beam.candidates[: self.params.num_candidates]:
                if mask_stop and token_id in self.params.stop_token_ids:
                    continue
                out.append(_Candidate(beam.score + logprob, beam, token_id, logprob, beam.candidates))
        return out

    def _hypothesis(self, candidate: _Candidate, num_tokens: int) -> Hypothesis:
        token_id = candidate.token_id
        if token_id in self.params.stop_token_ids:
            reason = FinishReason.EOS if token_id in self.params.eos_token_ids else FinishReason.STOP_TOKEN
        else:
            reason = FinishReason.LENGTH
        return Hypothesis(
            output_token_ids=(*candidate.beam.output_token_ids, token_id),
            score=candidate.score / num_tokens**self.params.length_penalty,
            finish_reason=reason,
            logprobs=self._logprobs(candidate),
        )

    def _logprobs(self, candidate: _Candidate) -> tuple[SampledToken, ...]:
        if not self.params.logprobs:
            return ()
        entry = SampledToken(
            req_id="",
            token_id=candidate.token_id,
            logprob=candidate.logprob,
            top_logprobs=candidate.top_logprobs[: self.params.top_logprobs],
        )
        return (*candidate.beam.logprobs, entry)

    def _update_improvable(self, running: Sequence[_Candidate]) -> None:
        """transformers' `_check_early_stop_heuristic`: can the best running beam still beat the worst hypothesis?"""
        params = self.params
        if not self._improvable or not running or len(self.hypotheses) < params.beam_width:
            return
        if params.early_stopping == "never" and params.length_penalty > 0.0:
            length = params.max_tokens
        else:
            length = self.generation
        best_possible = running[0].score / length**params.length_penalty
        self._improvable = best_possible > min(h.score for h in self.hypotheses)

    def _fork(self, running: Sequence[_Candidate]) -> BeamStep:
        children: dict[str, list[Request]] = {}
        beams = []
        for candidate in running:
            parent = candidate.beam
            beam = _Beam(
                req_id=self._new_id(),
                output_token_ids=[*parent.output_token_ids, candidate.token_id],
                score=candidate.score,
                logprobs=self._logprobs(candidate),
            )
            beams.append(beam)
            children.setdefault(parent.req_id, []).append(self._request(beam))
        finished = [b.req_id for b in self._beams if b.req_id not in children]
        forks = [(b.req_id, children[b.req_id]) for b in self._beams if b.req_id in children]
        self._beams = beams
        return BeamStep(finished, forks, False)

    # ---- the answer -----------------------------------------------------------------------

    def best(self) -> list[Hypothesis]:
        """The `n` best hypotheses, best first (once `done`)."""
        if not self.done:
            raise ValueError(f"beam search {self.request_id!r} is still running")
        return self.hypotheses[: self.params.n]


def apply_beam_step(scheduler: Scheduler, step: BeamStep) -> None:
    """Finish the beams nobody chose (freeing their blocks), then fork the chosen parents."""
    scheduler.finish_requests(step.finished_req_ids, FinishReason.LENGTH)
    for parent_id, children in step.forks:
        scheduler.fork_beams(parent_id, children)
