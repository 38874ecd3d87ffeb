"""Pagoda's `GenerateResponse` stream as the protocol's, shaped as vLLM's servicer shapes it.

    stream = true:   per Pagoda message, per index:  chunk(delta token ids, counts, logprobs)
                     and once that index ends:        complete(its last delta, finish reason)
    stream = false:  once every index has ended:      complete(all its token ids) per index

Every chunk and complete carries `prompt_tokens` and `cached_tokens` (the prompt's tokens found
in the prefix cache); a chunk's `completion_tokens` is its delta's count (the router adds them
up), a complete's the index's total. Finish reasons are vLLM's strings:

    Pagoda           finish_reason   matched_stop
    EOS              "stop"          (none: the model's end of sequence)
    STOP_TOKEN       "stop"          matched_token_id = the stop token (the last output id)
    STOP_SEQUENCE    "stop"          matched_stop_str = the stop string
    LENGTH           "length"
    ABORTED          "abort"

Logprobs (when asked): per output token its logprob and, with `logprobs = k > 0`, the top k
alternatives (`TopLogProbs`), as `OutputLogProbs`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from smg_grpc_proto import vllm_engine_pb2 as vpb

from pagoda.v1 import generation_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_EOS: "stop",
    pb.FINISH_REASON_STOP_TOKEN: "stop",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORTED: "abort",
}


@dataclass
class _Index:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finished: pb.SequenceOutput | None = None


class ResponseTranslator:
    """Feed it Pagoda's responses in order (`translate`); it yields the protocol's."""

    def __init__(self, stream: bool, logprobs: bool, top_logprobs: int):
        self.stream = stream
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._indexes: dict[int, _Index] = {}

    def translate(self, response: pb.GenerateResponse) -> Iterator[vpb.GenerateResponse]:
        if response.HasField("prompt_info"):
            self.prompt_tokens = response.prompt_info.num_prompt_tokens
            self.cached_tokens = response.prompt_info.num_cached_tokens
        for out in response.outputs:
            index = self._indexes.setdefault(out.index, _Index())
            index.token_ids.extend(out.token_ids)
            if not self.stream:
                index.logprobs.extend(out.logprobs)
            if out.finish_reason:
                index.finished = out
            if self.stream:
                yield vpb.GenerateResponse(chunk=self._chunk(out))
                if out.finish_reason:
                    yield vpb.GenerateResponse(complete=self._complete(out, list(out.token_ids), out.logprobs))
        if response.HasField("usage") and not self.stream:
            for number in sorted(self._indexes):
                index = self._indexes[number]
                if index.finished is not None:
                    yield vpb.GenerateResponse(complete=self._complete(index.finished, index.token_ids, index.logprobs))

    def _chunk(self, out: pb.SequenceOutput) -> vpb.GenerateStreamChunk:
        chunk = vpb.GenerateStreamChunk(
            token_ids=out.token_ids,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=len(out.token_ids),
            cached_tokens=self.cached_tokens,
            index=out.index,
        )
        if self.logprobs and out.logprobs:
            chunk.output_logprobs.CopyFrom(self._output_logprobs(out.logprobs))
        return chunk

    def _complete(self, out: pb.SequenceOutput, token_ids: list[int], logprobs) -> vpb.GenerateComplete:
        complete = vpb.GenerateComplete(
            output_ids=token_ids,
            finish_reason=FINISH_REASONS.get(out.finish_reason, "stop"),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=len(self._indexes[out.index].token_ids),
            cached_tokens=self.cached_tokens,
            index=out.index,
        )
        if out.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and out.matched_stop:
            complete.matched_stop_str = out.matched_stop
        elif out.finish_reason == pb.FINISH_REASON_STOP_TOKEN and self._indexes[out.index].token_ids:
            complete.matched_token_id = self._indexes[out.index].token_ids[-1]
        if self.logprobs and logprobs:
            complete.output_logprobs.CopyFrom(self._output_logprobs(logprobs))
        return complete

    def _output_logprobs(self, logprobs) -> vpb.OutputLogProbs:
        proto = vpb.OutputLogProbs()
        for entry in logprobs:
            proto.token_ids.append(entry.token_id)
            proto.token_logprobs.append(entry.logprob)
            if self.top_logprobs:
                proto.top_logprobs.append(
                    vpb.TopLogProbs(
                        token_ids=[t.token_id for t in entry.top[: self.top_logprobs]],
                        values=[t.logprob for t in entry.top[: self.top_logprobs]],
                    )
                )
        return proto
