"""The front end of one client request: its n output streams and the response queue.

The request's owners (`scheduler_svc.owners`) push each sampled token through
`on_token` (detokenize, match stop strings, collect logprobs); the gRPC handler drains
the queue with `responses()`, merging whatever piled up into one GenerateResponse. A
beam search streams nothing until it ends, then its n best sequences whole
(`emit_sequence`), so they arrive in one final message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from pagoda.reasoning import ReasoningSplitter
from pagoda.step import SampledToken
from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.detokenizer import IncrementalDetokenizer, StopStringMatcher
from scheduler_svc.errors import ServiceError
from scheduler_svc.validation import GenerateParams

log = logging.getLogger("scheduler_svc.engine")  # (the finish lines are the engine's)


@dataclass
class SampleStream:
    index: int
    core_req_id: str
    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    num_tokens: int = 0
    finished: bool = False
    finish_reason: int = 0
    last_token_time: float = 0.0
    num_accepted_draft_tokens: int = 0  # of its tokens, drafts the model accepted
    reasoning: ReasoningSplitter | None = None  # splits its text into reasoning and answer
    num_reasoning_tokens: int = 0  # of its tokens, those whose text went into the reasoning


@dataclass
class _Done:
    usage: pb.Usage


@dataclass
class ClientStream:
    """One client request. `key` = (tenant, request_id) names it to the engine; `core_id` its core requests."""

    params: GenerateParams
    samples: list[SampleStream]
    tenant: str = ""
    core_id: str = ""  # unique in the engine: core request ids are `<i>:<core_id>` (beams `beam<k>:<core_id>`)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    num_cached_tokens: int = 0
    prompt_info_sent: bool = False
    done: bool = False

    @classmethod
    def create(
        cls, params: GenerateParams, tokenizer: PreTrainedTokenizerBase, tenant: str = "", core_id: str | None = None
    ) -> ClientStream:
        core_id = params.request_id if core_id is None else core_id
        samples = [
            SampleStream(
                index=i,
                core_req_id=f"{i}:{core_id}",
                detokenizer=IncrementalDetokenizer(tokenizer, params.prompt_token_ids, params.skip_special_tokens),
                stop=StopStringMatcher(list(params.stop), params.include_stop_str_in_output),
                reasoning=ReasoningSplitter(*params.reasoning) if params.reasoning else None,
            )
            for i in range(params.n)
        ]
        return cls(params=params, samples=samples, tenant=tenant, core_id=core_id)

    @property
    def request_id(self) -> str:
        return self.params.request_id

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.params.request_id)

    def on_token(self, sample: SampleStream, sampled: SampledToken, finish_reason: int | None) -> str | None:
        """Emit one token of `sample`. Returns the stop string it completed, if any.

        The text of a token that ends the stream as EOS or stop token is not shown,
        as in vLLM; its id is.
        """
        sample.num_tokens += 1
        out = pb.SequenceOutput(index=sample.index, token_ids=[sampled.token_id])
        if self.params.sampling.logprobs:
            out.logprobs.append(
                pb.TokenLogprob(
                    token_id=sampled.token_id,
                    logprob=sampled.logprob,
                    top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in sampled.top_logprobs],
                )
            )
        delta = sample.detokenizer.push(sampled.token_id)
        ends_on_token = finish_reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_STOP_TOKEN)
        text, matched = sample.stop.feed("" if ends_on_token else delta)
        if matched is not None:
            finish_reason = pb.FINISH_REASON_STOP_SEQUENCE
            out.matched_stop = matched
        elif finish_reason is not None:
            text += sample.stop.flush()
        out.text, out.reasoning_text = _split(sample, text, finish_reason is not None)
        if out.reasoning_text:
            sample.num_reasoning_tokens += 1
        if finish_reason is not None:
            out.finish_reason = finish_reason
            sample.finished = True
            sample.finish_reason = finish_reason
        self.queue.put_nowait(out)
        return matched

    def emit_sequence(
        self, sample: SampleStream, token_ids: list[int], logprobs: list[SampledToken], finish_reason: int
    ) -> None:
        """Emit a whole sequence of `sample` at once (`logprobs`: one per token, or empty)."""
        for i, token_id in enumerate(token_ids):
            sampled = logprobs[i] if logprobs else SampledToken(sample.core_req_id, token_id)
            self.on_token(sample, sampled, finish_reason if i == len(token_ids) - 1 else None)

    def finish_sample(self, sample: SampleStream, reason: int) -> None:
        """End `sample` without a token (abort)."""
        if sample.finished:
            return
        sample.finished = True
        sample.finish_reason = reason
        text, reasoning = _split(sample, sample.stop.flush(), True)
        self.queue.put_nowait(pb.SequenceOutput(index=sample.index, text=text, reasoning_text=reasoning, finish_reason=reason))

    def finish_if_done(self) -> bool:
        if self.done or not all(s.finished for s in self.samples):
            return False
        self.done = True
        completion = sum(s.num_tokens for s in self.samples)
        self.queue.put_nowait(
            _Done(
                pb.Usage(
                    prompt_tokens=len(self.params.prompt_token_ids),
                    completion_tokens=completion,
                    cached_prompt_tokens=self.num_cached_tokens,
                    accepted_draft_tokens=sum(s.num_accepted_draft_tokens for s in self.samples),
                    reasoning_tokens=sum(s.num_reasoning_tokens for s in self.samples),
                )
            )
        )
        return True

    def log_finish(self, metrics) -> None:
        """Log the finished request and count it (`scheduler_svc.metrics.Metrics`)."""
        reasons = [s.finish_reason for s in self.samples]
        log.info(
            "request %r finished: %s tokens, reasons %s",
            self.request_id, [s.num_tokens for s in self.samples], [pb.FinishReason.Name(r) for r in reasons],
        )
        metrics.observe_finish(self.arrival, len(self.params.prompt_token_ids), reasons)

    def fail(self, error: ServiceError) -> None:
        self.done = True
        for sample in self.samples:
            sample.finished = True
        self.queue.put_nowait(error)

    async def responses(self):
        """Yield merged GenerateResponses until the request ends; raise its ServiceError if it fails.

        Tokens that queued up while the client read are merged into one response, except for a
        request that asked for logprobs: each of its responses holds one token per sequence, so
        that a token's text delta is its own (the OpenAI gateway names logprob tokens by it).
        """
        one_token = self.params.sampling.logprobs
        while True:
            items = [await self.queue.get()]
            while not self.queue.empty() and not one_token:
                items.append(self.queue.get_nowait())
            response = pb.GenerateResponse(request_id=self.request_id)
            if not self.prompt_info_sent:
                self.prompt_info_sent = True
                response.prompt_info.num_prompt_tokens = len(self.params.prompt_token_ids)
                response.prompt_info.num_cached_tokens = self.num_cached_tokens
            merged: dict[int, pb.SequenceOutput] = {}
            finished = False
            error: ServiceError | None = None
            for item in items:
                if isinstance(item, ServiceError):
                    error = item
                    break
                if isinstance(item, _Done):
                    response.usage.CopyFrom(item.usage)
                    finished = True
                    continue
                if item.index in merged:
                    _merge(merged[item.index], item)
                else:
                    merged[item.index] = item
            response.outputs.extend(merged[i] for i in sorted(merged))
            if merged or finished or error is None:
                yield response
            if error is not None:
                raise error
            if finished:
                return


def _split(sample: SampleStream, text: str, last: bool) -> tuple[str, str]:
    """(answer, reasoning) of the sample's text delta; `last`: release what the splitter holds."""
    if sample.reasoning is None:
        return text, ""
    reasoning, content = sample.reasoning.feed(text)
    if last:
        more_reasoning, more_content = sample.reasoning.flush()
        reasoning, content = reasoning + more_reasoning, content + more_content
    return content, reasoning


def _merge(into: pb.SequenceOutput, more: pb.SequenceOutput) -> None:
    into.text += more.text
    into.reasoning_text += more.reasoning_text
    into.token_ids.extend(more.token_ids)
    into.logprobs.extend(more.logprobs)
    if more.finish_reason:
        into.finish_reason = more.finish_reason
    if more.matched_stop:
        into.matched_stop = more.matched_stop
