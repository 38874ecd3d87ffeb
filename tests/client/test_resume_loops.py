"""The sync and async stream loops around a break, against a small server of the test's own that
drops the first stream after two tokens with UNAVAILABLE (as a restarting scheduler does)."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from pagoda.client import AsyncClient, Client, FinishReason, RetryPolicy, Unavailable
from pagoda.v1 import generation_pb2 as pb
from pagoda.v1 import generation_pb2_grpc as pb_grpc
from tests.service.harness import free_port

PROMPT_IDS = [7, 8, 9]


class BreakingServicer(pb_grpc.GenerationServicer):
    def __init__(self):
        self.requests: list[pb.GenerateRequest] = []

    def Tokenize(self, request, context):
        return pb.TokenizeResponse(token_ids=PROMPT_IDS, tokens=["a", "b", "c"])

    def Generate(self, request, context):
        self.requests.append(request)
        out = lambda ids, text, **kw: pb.SequenceOutput(index=0, token_ids=ids, text=text, **kw)  # noqa: E731
        if ".resume" not in request.request_id:
            yield pb.GenerateResponse(prompt_info=pb.PromptInfo(num_prompt_tokens=3), outputs=[out([1], "He")])
            yield pb.GenerateResponse(outputs=[out([2], "llo")])
            context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler restarting")
        yield pb.GenerateResponse(prompt_info=pb.PromptInfo(num_prompt_tokens=5), outputs=[out([3], " world")])
        yield pb.GenerateResponse(outputs=[out([4], "!", finish_reason=pb.FINISH_REASON_LENGTH)],
                                  usage=pb.Usage(prompt_tokens=5, completion_tokens=2))


@pytest.fixture
def server():
    servicer = BreakingServicer()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(servicer, srv)
    port = srv.add_insecure_port(f"127.0.0.1:{free_port()}")
    srv.start()
    yield f"127.0.0.1:{port}", servicer
    srv.stop(0)


def _check(servicer, chunks, usage):
    assert "".join(c.text for c in chunks) == "Hello world!"
    assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4]
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert (usage.prompt_tokens, usage.completion_tokens) == (3, 4)
    first, resumed = servicer.requests
    assert first.text == "Hello?" and list(resumed.token_ids.ids) == [*PROMPT_IDS, 1, 2]
    assert resumed.stopping.max_tokens == 2 and resumed.sampling.seed == first.sampling.seed


def test_the_sync_client_resumes_a_text_prompt_after_tokenizing_it(server):
    address, servicer = server
    with Client(address, retry=RetryPolicy(initial_backoff=0.01)) as client:
        stream = client.generate("Hello?", max_tokens=4, temperature=0.7)  # seeded by the client
        chunks = list(stream)
    _check(servicer, chunks, stream.usage)


def test_the_async_client_resumes_the_same_way(server):
    address, servicer = server

    async def run():
        async with AsyncClient(address, retry=RetryPolicy(initial_backoff=0.01)) as client:
            stream = client.generate("Hello?", max_tokens=4, temperature=0.7)
            return [c async for c in stream], stream.usage

    chunks, usage = asyncio.run(run())
    _check(servicer, chunks, usage)


def test_without_resume_the_break_is_raised(server):
    address, _ = server
    with Client(address, resume=False) as client:
        with pytest.raises(Unavailable, match="restarting"):
            list(client.generate("Hello?", max_tokens=4, temperature=0.0))
