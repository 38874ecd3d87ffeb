"""Who a core request belongs to: each core request id has exactly one owner.

A client request (`ClientStream`) is served by core requests: one per sample (`n`
samples: `SampleOwner` each), or the live beams of one beam search (`BeamOwner`, whose
beams change every generation). The engine routes every `RequestUpdate` of a step to
the owner of its request id, and every request of an executor that is gone to the owner
too, which says what to queue again:

    SampleOwner.on_executor_lost(request)  -> [request]        tokens so far kept (recompute)
    BeamOwner.on_executor_lost(beam)       -> every live beam, restarted together, once

`Owners` is the one map from core request id to owner.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from scheduler_svc.beam_search import BeamSearch, BeamSearchParams, apply_beam_step
from scheduler_svc.client_stream import ClientStream, SampleStream
from scheduler_svc.core import FinishReason, Request, RequestUpdate, Scheduler
from scheduler_svc.metrics import Metrics

_U64 = 2**64


class Owners:
    """Core request id -> its owner."""

    def __init__(self) -> None:
        self._by_id: dict[str, SampleOwner | BeamOwner] = {}

    def claim(self, req_ids, owner: SampleOwner | BeamOwner) -> None:
        for req_id in req_ids:
            self._by_id[req_id] = owner

    def release(self, req_ids) -> None:
        for req_id in req_ids:
            self._by_id.pop(req_id, None)

    def get(self, req_id: str) -> SampleOwner | BeamOwner | None:
        return self._by_id.get(req_id)

    def __len__(self) -> int:
        return len(self._by_id)


@dataclass(eq=False)
class SampleOwner:
    """One sample of a client request: its core request streams token by token."""

    stream: ClientStream
    sample: SampleStream
    request: Request
    metrics: Metrics

    @classmethod
    def for_samples(cls, stream: ClientStream, max_tokens: int, metrics: Metrics) -> list[SampleOwner]:
        params, now = stream.params, time.monotonic()
        owners = []
        for sample in stream.samples:
            sampling = params.sampling
            if sampling.seed is not None and sample.index > 0:  # sample i draws with seed + i
                sampling = replace(sampling, seed=(sampling.seed + sample.index) % _U64)
            request = Request(
                req_id=sample.core_req_id,
                prompt_token_ids=list(params.prompt_token_ids),
                sampling=sampling,
                max_tokens=max_tokens,
                eos_token_ids=params.eos_token_ids,
                priority=params.priority,
                arrival_time=now,
                cache_salt=params.cache_salt,
                tenant=stream.tenant,
                lora=params.lora,
                images=params.images,
            )
            owners.append(cls(stream, sample, request, metrics))
        return owners

    @property
    def live_req_ids(self) -> list[str]:
        return [] if self.sample.finished else [self.request.req_id]

    @property
    def done(self) -> bool:
        return self.sample.finished

    def on_update(self, scheduler: Scheduler, update: RequestUpdate, owners: Owners) -> None:
        stream, sample = self.stream, self.sample
        self._observe_token()
        sample.num_accepted_draft_tokens = self.request.num_accepted_draft_tokens
        reason = None if update.finish_reason is None else int(update.finish_reason)
        matched = stream.on_token(sample, update.sampled, reason)
        if matched is not None and update.finish_reason is None:
            scheduler.finish_requests([update.req_id], FinishReason.STOP_SEQUENCE)
        if sample.finished:
            owners.release([update.req_id])

    def on_executor_lost(self, request: Request, owners: Owners) -> list[Request]:
        return [request]

    def abort(self, reason: int, owners: Owners) -> None:
        owners.release(self.live_req_ids)
        self.stream.finish_sample(self.sample, reason)

    def _observe_token(self) -> None:
        now, sample, metrics = time.monotonic(), self.sample, self.metrics
        if sample.num_tokens == 0:
            if sample.index == 0:
                self.stream.num_cached_tokens = self.request.num_cached_tokens
                metrics.observe_first_token(self.stream.arrival, len(self.stream.params.prompt_token_ids), self.request.num_cached_tokens)
        else:
            metrics.itl.observe(now - sample.last_token_time)
        sample.last_token_time = now
        metrics.generation_tokens.inc()


@dataclass(eq=False)
class BeamOwner:
    """A beam search: its live beams are core requests; its n best sequences go out at the end."""

    stream: ClientStream
    search: BeamSearch
    metrics: Metrics

    @classmethod
    def create(cls, stream: ClientStream, max_tokens: int, metrics: Metrics, vocab_size: int = 0) -> BeamOwner:
        params, sampling = stream.params, stream.params.sampling
        search = BeamSearch(
            request_id=stream.core_id or params.request_id,
            prompt_token_ids=list(params.prompt_token_ids),
            params=BeamSearchParams(
                beam_width=params.beam_width,
                max_tokens=max_tokens,
                n=params.n,
                stop_token_ids=frozenset(sampling.stop_token_ids),
                eos_token_ids=params.eos_token_ids,
                min_tokens=sampling.min_tokens,
                logprobs=sampling.logprobs,
                top_logprobs=sampling.top_logprobs,
                vocab_size=vocab_size,  # never more candidates than tokens (#16)
            ),
            priority=params.priority,
            arrival_time=time.monotonic(),
            cache_salt=params.cache_salt,
            tenant=stream.tenant,
            lora=params.lora,
            images=params.images,
        )
        return cls(stream, search, metrics)

    @property
    def live_req_ids(self) -> list[str]:
        return self.search.live_req_ids

    @property
    def done(self) -> bool:
        return self.search.done

    def on_update(self, scheduler: Scheduler, update: RequestUpdate, owners: Owners) -> None:
        """A beam's candidates; once its generation is complete, finish and fork beams in the core."""
        search = self.search
        if search.generation == 0:
            root = scheduler.get_request(update.req_id)
            self.stream.num_cached_tokens = root.num_cached_tokens if root is not None else 0
        beam_step = search.on_sampled(update.sampled)
        if beam_step is None:
            return
        owners.release([*beam_step.finished_req_ids, *(parent_id for parent_id, _ in beam_step.forks)])
        apply_beam_step(scheduler, beam_step)
        for _, children in beam_step.forks:
            owners.claim([child.req_id for child in children], self)
        if beam_step.done:
            self._emit_results()

    def on_executor_lost(self, request: Request, owners: Owners) -> list[Request]:
        """The first lost beam restarts every live beam, together; the others are then stale."""
        owners.release(self.search.live_req_ids)
        beams = self.search.restart()
        owners.claim([beam.req_id for beam in beams], self)
        return beams

    def abort(self, reason: int, owners: Owners) -> None:
        owners.release(self.live_req_ids)
        for sample in self.stream.samples:
            self.stream.finish_sample(sample, reason)

    def _emit_results(self) -> None:
        stream = self.stream
        self.metrics.observe_first_token(stream.arrival, len(stream.params.prompt_token_ids), stream.num_cached_tokens)
        for sample, hypothesis in zip(stream.samples, self.search.best()):
            tokens = list(hypothesis.output_token_ids)
            stream.emit_sequence(sample, tokens, list(hypothesis.logprobs), int(hypothesis.finish_reason))
            self.metrics.generation_tokens.inc(len(tokens))


def owners_for(
    stream: ClientStream, max_tokens: int, metrics: Metrics, vocab_size: int = 0
) -> list[SampleOwner] | list[BeamOwner]:
    """The owners of a new client request; their core requests are `initial_requests(...)`."""
    if stream.params.beam_width > 1:
        return [BeamOwner.create(stream, max_tokens, metrics, vocab_size)]
    return SampleOwner.for_samples(stream, max_tokens, metrics)


def initial_requests(owners: list[SampleOwner] | list[BeamOwner]) -> list[Request]:
    """One group: the n samples (siblings sharing the prompt), or a beam search's root."""
    if isinstance(owners[0], BeamOwner):
        return [owners[0].search.root()]
    return [owner.request for owner in owners]

