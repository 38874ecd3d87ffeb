"""What the sync and async clients share: configuration and turning a call into a stream state."""

from __future__ import annotations

import uuid

from grpc_health.v1 import health_pb2

from pagoda.client.connection import Connection, RetryPolicy, TLSConfig, parse_targets
from pagoda.client.resume import StreamAttempts, auto_seed
from pagoda.client.types import GenerateParams, Prompt, build_request, chat_messages, chat_tools
from pagoda.v1 import generation_pb2 as pb

HEALTH_REQUEST = health_pb2.HealthCheckRequest(service="pagoda.v1.Generation")
SERVING = health_pb2.HealthCheckResponse.SERVING


class ClientBase:
    """`targets`: one "host:port", a comma-separated list or a list (default `PAGODA_TARGET`,
    else 127.0.0.1:50051); calls go to the first and move on when one is UNAVAILABLE.
    `timeout`: the default deadline of a call in seconds (a whole stream, resumes included).
    `resume`: continue broken streams where that is exact (see `pagoda.client.resume`);
    `auto_seed`: give sampled requests without a seed a random one, so they are resumable."""

    def __init__(self, targets: str | list[str] | None = None, *, api_key: str | None = None,
                 tls: TLSConfig | bool | None = None, timeout: float | None = None,
                 retry: RetryPolicy = RetryPolicy(), resume: bool = True, auto_seed: bool = True):
        if tls is True:
            tls = TLSConfig()
        self.connection = Connection(parse_targets(targets), api_key, tls or None)
        self.timeout = timeout
        self.retry = retry
        self.resume = resume
        self.auto_seed = auto_seed

    @property
    def targets(self) -> tuple[str, ...]:
        return self.connection.targets

    def _metadata(self, api_key: str | None) -> tuple[tuple[str, str], ...]:
        """Call metadata: the client's API key, or `api_key` for this call (a gateway passing
        its caller's key through)."""
        return self.connection.metadata(api_key)

    def _stream_state(self, prompt: Prompt | None, chat, params: GenerateParams | None, request_id: str | None,
                      timeout: float | None, api_key: str | None, overrides: dict) -> StreamAttempts:
        params = GenerateParams.of(params, **overrides)
        req = build_request(prompt, chat, params, request_id or uuid.uuid4().hex)
        if self.resume and self.auto_seed:
            auto_seed(req)
        return StreamAttempts(req, self.retry, len(self.targets), timeout or self.timeout, self.resume,
                              self._metadata(api_key))

    @staticmethod
    def _tokenize_request(text: str | None, messages, add_generation_prompt: bool | None,
                          tools=()) -> pb.TokenizeRequest:
        if (text is None) == (messages is None):
            raise ValueError("tokenize: give exactly one of text or messages")
        if text is not None:
            if tools:
                raise ValueError("tokenize: tools need messages")
            return pb.TokenizeRequest(text=text)
        req = pb.TokenizeRequest(chat=pb.Chat(messages=chat_messages(messages), tools=chat_tools(tools)))
        if add_generation_prompt is not None:
            req.add_generation_prompt = add_generation_prompt
        return req
