"""One logical Generate stream over several RPC attempts: safe retries and resumption.

The sync and async clients run the same loop around this state (I/O is theirs, decisions
are here):

    request ──▶ attempt 0 on targets[0] ── chunks ──▶ caller
                   │ UNAVAILABLE (connection lost, scheduler restarted)
                   ▼
    no token delivered yet ──▶ the same request on the next address
    tokens delivered, resumable ──▶ prompt ids + tokens[:released], remaining budget
    otherwise ──▶ the error is raised

Resumption is exact (the caller cannot see the break) when the continuation samples the
same tokens: greedy requests, and seeded ones, because the executor seeds each draw from
(seed, absolute position), which is unchanged when received tokens move into the prompt.
Requests the server would treat differently are not resumed: presence / frequency
penalties count *output* tokens only, stop strings may be half-matched in text the server
held back, n > 1 and beam search return several interleaved sequences, and a constraint's
grammar would start again at the received tokens (now prompt).

Text the server holds back: a token that ends inside a multi-byte character arrives with
empty text. Its bytes complete only with the next token, which a continuation server would
not know to prepend. So the continuation restarts after the last chunk that carried text
(`released` tokens); the tokens after it are generated again, their ids checked against
those already delivered (`ResumeMismatch` if they differ) and not delivered twice, while
their text is.
"""

from __future__ import annotations

import random
import time

import grpc

from pagoda.client.connection import RetryPolicy
from pagoda.client.errors import PagodaError, ResumeMismatch, from_rpc_error
from pagoda.client.types import Chunk, Usage
from pagoda.v1 import generation_pb2 as pb

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})


def auto_seed(req: pb.GenerateRequest) -> None:
    """Give a sampled request without a seed a random one, so that it can be resumed exactly.
    Any seed draws from the same distribution; the seed only makes the draw repeatable."""
    sampling = req.sampling
    greedy = sampling.HasField("temperature") and sampling.temperature == 0
    if not greedy and not sampling.HasField("seed"):
        sampling.seed = random.getrandbits(63)


def resumable(req: pb.GenerateRequest) -> bool:
    s = req.sampling
    deterministic = (s.HasField("temperature") and s.temperature == 0) or s.HasField("seed")
    return (
        deterministic
        and s.n <= 1
        and s.beam_width <= 1
        and not s.presence_penalty
        and not s.frequency_penalty
        and not req.stopping.stop
        and not req.HasField("constraint")
    )


class StreamAttempts:
    """The state of one stream across attempts; see the module docstring."""

    def __init__(self, request: pb.GenerateRequest, policy: RetryPolicy, num_targets: int,
                 timeout: float | None, resume: bool, metadata: tuple[tuple[str, str], ...] = ()):
        self.request = request
        self.metadata = metadata
        self.request_id = request.request_id
        self.policy = policy
        self.num_targets = num_targets
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.resume = resume and resumable(request)
        self.attempt = 0
        self.target_index = 0
        self.prompt_ids: list[int] | None = list(request.token_ids.ids) if request.HasField("token_ids") else None
        self.delivered: list[int] = []  # token ids of index 0 handed to the caller
        self.released = 0  # of those, how many have had their text delivered too
        self._replay: list[int] = []  # ids the current attempt regenerates before new ones
        self._base = 0  # tokens of the output already in the current attempt's prompt
        self.num_prompt_tokens: int | None = None
        self.num_cached_tokens = 0
        self.usage: Usage | None = None
        self.started = False  # something was handed to the caller: retrying means resuming

    # -- the next attempt ----------------------------------------------------------

    @property
    def resuming(self) -> bool:
        return self.started

    def needs_prompt_ids(self) -> bool:
        return self.resuming and self.prompt_ids is None

    def tokenize_request(self) -> pb.TokenizeRequest:
        kind = self.request.WhichOneof("prompt")
        if kind == "chat":
            return pb.TokenizeRequest(chat=self.request.chat)
        return pb.TokenizeRequest(text=self.request.text)

    def set_prompt_ids(self, ids: list[int]) -> None:
        if self.num_prompt_tokens is not None and len(ids) != self.num_prompt_tokens:
            raise PagodaError(
                f"cannot resume {self.request_id}: Tokenize gave {len(ids)} prompt tokens, "
                f"the stream reported {self.num_prompt_tokens}", grpc.StatusCode.DATA_LOSS)
        self.prompt_ids = list(ids)

    def next_request(self) -> pb.GenerateRequest:
        """The request of the current attempt: the original, or its continuation."""
        if not self.resuming:
            req = pb.GenerateRequest()
            req.CopyFrom(self.request)
            if self.attempt:
                req.request_id = f"{self.request_id}.retry{self.attempt}"
            return req
        kept = self.delivered[: self.released]
        req = pb.GenerateRequest()
        req.CopyFrom(self.request)
        req.request_id = f"{self.request_id}.resume{self.attempt}"
        req.token_ids.ids[:] = [*self.prompt_ids, *kept]
        stopping = req.stopping
        if self.request.stopping.HasField("max_tokens"):
            stopping.max_tokens = self.request.stopping.max_tokens - len(kept)
        if self.request.stopping.HasField("min_tokens"):
            stopping.min_tokens = max(0, self.request.stopping.min_tokens - len(kept))
        self._replay = self.delivered[self.released :]
        self._base = len(kept)
        return req

    def target(self) -> int:
        return self.target_index

    def timeout(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.001)

    # -- what arrives --------------------------------------------------------------

    def accept(self, msg: pb.GenerateResponse) -> list[Chunk]:
        """The caller's chunks of one response (replayed token ids removed)."""
        if msg.HasField("prompt_info") and self.num_prompt_tokens is None:
            self.num_prompt_tokens = msg.prompt_info.num_prompt_tokens
            self.num_cached_tokens = msg.prompt_info.num_cached_tokens
        chunks = []
        for out in msg.outputs:
            chunk = Chunk.from_proto(out)
            if chunk.index == 0 and self._replay:
                chunk = self._drop_replayed(chunk)
            if chunk.index == 0:
                self.delivered.extend(chunk.token_ids)
                if chunk.text or chunk.reasoning_text or chunk.finish_reason is not None:
                    self.released = len(self.delivered)
            if chunk.text or chunk.reasoning_text or chunk.token_ids or chunk.finish_reason is not None:
                chunks.append(chunk)
                self.started = True
        if msg.HasField("usage"):
            self.usage = self._usage(msg.usage)
        return chunks

    def _drop_replayed(self, chunk: Chunk) -> Chunk:
        k = min(len(self._replay), len(chunk.token_ids))
        if list(chunk.token_ids[:k]) != self._replay[:k]:
            raise ResumeMismatch(
                f"resumed stream {self.request_id} regenerated {list(chunk.token_ids[:k])}, "
                f"delivered before the break: {self._replay[:k]}")
        self._replay = self._replay[k:]
        return Chunk(chunk.index, chunk.text, chunk.token_ids[k:], chunk.logprobs[k:],
                     chunk.finish_reason, chunk.matched_stop, chunk.reasoning_text)

    def _usage(self, usage: pb.Usage) -> Usage:
        if not self._base:
            return Usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens, usage.reasoning_tokens)
        # resumed: the reasoning tokens of the attempts before the break are not known here (a lower bound)
        return Usage(self.num_prompt_tokens or 0, self._base + usage.completion_tokens, self.num_cached_tokens,
                     usage.reasoning_tokens)

    def complete(self) -> bool:
        """Whether the stream ended properly (the last message, with usage, arrived)."""
        return self.usage is not None

    # -- failures ------------------------------------------------------------------

    def on_error(self, err: grpc.RpcError | None) -> float:
        """After a failed attempt (`err` None: the stream ended early): raise the typed error,
        or move to the next address and return the seconds to wait before trying it."""
        if err is not None and err.code() not in RETRYABLE:
            raise from_rpc_error(err)
        broken = from_rpc_error(err) if err is not None else PagodaError(
            f"stream {self.request_id} ended before it finished", grpc.StatusCode.UNAVAILABLE)
        if self.resuming and not self.resume:
            raise broken
        if self.attempt + 1 >= self.policy.max_attempts:
            raise broken
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise broken
        self.attempt += 1
        self.target_index = (self.target_index + 1) % self.num_targets
        return self.policy.backoff(self.attempt, self.num_targets)


def unary_retry_wait(err: grpc.RpcError, attempt: int, policy: RetryPolicy, num_targets: int) -> float:
    """For unary calls: raise the typed error unless UNAVAILABLE can be tried again."""
    if err.code() not in RETRYABLE or attempt + 1 >= policy.max_attempts:
        raise from_rpc_error(err)
    return policy.backoff(attempt + 1, num_targets)


class StreamView:
    """What a caller reads of a stream, sync or async: its id, usage once ended, and tries."""

    def __init__(self, state: StreamAttempts):
        self._state = state

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def usage(self):
        return self._state.usage

    @property
    def num_prompt_tokens(self) -> int | None:
        """The prompt's tokens, known from the first response on (None before it)."""
        return self._state.num_prompt_tokens

    @property
    def num_cached_tokens(self) -> int | None:
        """The prompt's tokens read from the prefix cache, known from the first response on."""
        return self._state.num_cached_tokens

    @property
    def num_attempts(self) -> int:
        return self._state.attempt + 1
