"""Pagoda's Python client: `Client` (blocking) and `AsyncClient` (asyncio) over grpcio.

    from pagoda.client import Client
    with Client("127.0.0.1:50051") as client:
        for chunk in client.chat([{"role": "user", "content": "Hi!"}], max_tokens=64, temperature=0):
            print(chunk.text, end="", flush=True)

Streams retry UNAVAILABLE on the next address before the first token, and resume after it
where the continuation is exact (greedy or seeded requests; see `pagoda.client.resume`).
Errors are typed (`pagoda.client.errors`), named after their gRPC status.
"""

from pagoda.client.async_client import AsyncClient, AsyncStream
from pagoda.client.connection import RetryPolicy, TLSConfig
from pagoda.client.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PagodaError,
    PermissionDenied,
    ResourceExhausted,
    ResumeMismatch,
    Unauthenticated,
    Unavailable,
)
from pagoda.client.sync_client import Client, Stream
from pagoda.client.types import (
    ChatMessage,
    Chunk,
    Completion,
    Embeddings,
    ExecutorInfo,
    FinishReason,
    GenerateParams,
    ModelInfo,
    Output,
    Reranked,
    RerankResult,
    ServerInfo,
    TokenLogprob,
    Tokens,
    TopLogprob,
    Usage,
)

__all__ = [
    "AlreadyExists", "AsyncClient", "AsyncStream", "Cancelled", "ChatMessage", "Chunk", "Client", "Completion",
    "DeadlineExceeded", "Embeddings", "ExecutorInfo", "FailedPrecondition", "FinishReason", "GenerateParams", "InvalidArgument",
    "ModelInfo", "NotFound", "Output", "PagodaError", "PermissionDenied", "Reranked", "RerankResult", "ResourceExhausted", "ResumeMismatch",
    "RetryPolicy", "ServerInfo", "Stream", "TLSConfig", "TokenLogprob", "Tokens", "TopLogprob", "Unauthenticated",
    "Unavailable", "Usage",
]
