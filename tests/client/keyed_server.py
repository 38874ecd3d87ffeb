"""A stand-in for a scheduler started with `--api-key`: UNAUTHENTICATED without the bearer key."""

from __future__ import annotations

import contextlib
from concurrent import futures

import grpc

from pagoda.v1 import generation_pb2 as pb
from pagoda.v1 import generation_pb2_grpc as pb_grpc
from tests.service.harness import free_port

KEY = "s3cret-key"


class KeyedServicer(pb_grpc.GenerationServicer):
    """Answers like a scheduler started with --api-key: UNAUTHENTICATED without the bearer key."""

    def _check(self, context):
        if dict(context.invocation_metadata()).get("authorization") != f"Bearer {KEY}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or wrong API key")

    def GetModelInfo(self, request, context):
        self._check(context)
        return pb.ModelInfo(name="keyed", vocab_size=3)

    def Generate(self, request, context):
        self._check(context)
        yield pb.GenerateResponse(outputs=[pb.SequenceOutput(index=0, token_ids=[1], text="ok")])
        yield pb.GenerateResponse(outputs=[pb.SequenceOutput(index=0, token_ids=[2], text="!",
                                                             finish_reason=pb.FINISH_REASON_LENGTH)],
                                  usage=pb.Usage(prompt_tokens=1, completion_tokens=2))


@contextlib.contextmanager
def insecure_keyed_server(servicer: KeyedServicer | None = None):
    """Yield the host:port of a plaintext KeyedServicer (`servicer`, or a new one)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(servicer or KeyedServicer(), server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)
