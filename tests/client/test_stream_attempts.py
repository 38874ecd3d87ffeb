"""The resumption state machine without a server: continuation requests, replay, usage."""

from __future__ import annotations

import grpc
import pytest

from pagoda.client.connection import RetryPolicy
from pagoda.client.errors import InvalidArgument, ResumeMismatch, Unavailable
from pagoda.client.resume import StreamAttempts, auto_seed, resumable
from pagoda.client.types import GenerateParams, build_request
from pagoda.v1 import generation_pb2 as pb


class FakeRpcError(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "fake"


def _state(resume=True, **params):
    req = build_request([5, 6, 7], None, GenerateParams(**params), "r1")
    return StreamAttempts(req, RetryPolicy(max_attempts=4), num_targets=2, timeout=None, resume=resume)


def _msg(ids, text, finish=0, usage=None, prompt=None):
    msg = pb.GenerateResponse(outputs=[pb.SequenceOutput(index=0, token_ids=ids, text=text, finish_reason=finish)])
    if usage:
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=usage[0], completion_tokens=usage[1]))
    if prompt:
        msg.prompt_info.num_prompt_tokens = prompt
    return msg


def test_continuation_starts_after_the_last_chunk_with_text_and_replays_the_rest():
    state = _state(temperature=0.0, max_tokens=10, min_tokens=4)
    state.accept(_msg([11], "a", prompt=3))
    state.accept(_msg([12], "b"))
    state.accept(_msg([13], ""))  # ends inside a multi-byte character: text held back
    assert state.on_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE)) == 0.0
    assert state.target() == 1
    req = state.next_request()
    assert list(req.token_ids.ids) == [5, 6, 7, 11, 12]
    assert req.stopping.max_tokens == 8 and req.stopping.min_tokens == 2
    assert req.request_id == "r1.resume1"
    # The continuation regenerates 13 with its text: the id is not delivered twice, the text is.
    chunks = state.accept(_msg([13, 14], "€c", prompt=5))
    assert [(c.token_ids, c.text) for c in chunks] == [((14,), "€c")]
    state.accept(_msg([15], "d", finish=pb.FINISH_REASON_LENGTH, usage=(5, 3)))
    assert state.complete()
    assert state.usage.prompt_tokens == 3 and state.usage.completion_tokens == 5
    assert state.delivered == [11, 12, 13, 14, 15]


def test_a_replay_that_differs_from_what_was_delivered_raises():
    state = _state(temperature=0.0)
    state.accept(_msg([11], ""))
    state.on_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE))
    state.next_request()
    with pytest.raises(ResumeMismatch):
        state.accept(_msg([99], "x"))


def test_not_resumable_requests_raise_after_the_first_token_but_retry_before_it():
    state = _state(temperature=0.7, presence_penalty=0.5)  # no seed, penalty on output tokens
    assert not resumable(state.request)
    state.on_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE))  # nothing delivered: retried
    assert state.next_request().request_id == "r1.retry1"
    state.accept(_msg([11], "a"))
    with pytest.raises(Unavailable):
        state.on_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE))


def test_other_statuses_are_raised_typed_and_attempts_are_bounded():
    with pytest.raises(InvalidArgument):
        _state().on_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT))
    state = _state(temperature=0.0)
    waits = [state.on_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE)) for _ in range(3)]
    assert waits == [0.0, 0.25, 0.0]  # the other address at once, then a pause per round
    with pytest.raises(Unavailable):
        state.on_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE))


def test_auto_seed_makes_sampled_requests_resumable_and_leaves_greedy_alone():
    sampled = build_request("hi", None, GenerateParams(temperature=0.8), "x")
    auto_seed(sampled)
    assert sampled.sampling.HasField("seed") and resumable(sampled)
    greedy = build_request("hi", None, GenerateParams(temperature=0.0), "y")
    auto_seed(greedy)
    assert not greedy.sampling.HasField("seed") and resumable(greedy)
    assert not resumable(build_request("hi", None, GenerateParams(temperature=0.0, stop=["\n"]), "z"))
