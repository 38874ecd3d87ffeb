"""`AsyncClient`: the asyncio client over grpc.aio (the same behaviour as `Client`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence

import grpc
from grpc_health.v1.health_pb2_grpc import HealthStub

from pagoda.client.base import HEALTH_REQUEST, SERVING, ClientBase
from pagoda.client.resume import StreamAttempts, StreamView, unary_retry_wait
from pagoda.client.types import (
    Chunk, Completion, EmbedInput, Embeddings, GenerateParams, ModelInfo, Prompt, Reranked, ServerInfo, Tokens,
    embed_request, rerank_request,
)
from pagoda.v1 import generation_pb2 as pb
from pagoda.v1 import generation_pb2_grpc as pb_grpc


class AsyncStream(StreamView):
    """`async for chunk in stream`; `usage` is set once it has ended. Cancelling the consuming
    task, breaking out (then `await stream.aclose()`) or a deadline cancels the request."""

    def __init__(self, client: AsyncClient, state: StreamAttempts):
        super().__init__(state)
        self._client = client
        self._iter = self._run()

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._iter

    async def __anext__(self) -> Chunk:
        return await self._iter.__anext__()

    async def aclose(self) -> None:
        await self._iter.aclose()

    async def collect(self) -> Completion:
        return Completion.join(self.request_id, [c async for c in self], self.usage)

    async def _run(self) -> AsyncIterator[Chunk]:
        state, client = self._state, self._client
        while True:
            call = None
            try:
                stub = client._stub(state.target())
                if state.needs_prompt_ids():
                    reply = await stub.Tokenize(state.tokenize_request(), timeout=state.timeout(), metadata=state.metadata)
                    state.set_prompt_ids(list(reply.token_ids))
                call = stub.Generate(state.next_request(), timeout=state.timeout(), metadata=state.metadata)
                async for msg in call:
                    for chunk in state.accept(msg):
                        yield chunk
                if state.complete():
                    return
                wait = state.on_error(None)
            except grpc.aio.AioRpcError as err:
                wait = state.on_error(err)
            finally:
                if call is not None:
                    call.cancel()
            await asyncio.sleep(wait)


class AsyncClient(ClientBase):
    """asyncio Pagoda client; channels open on first use, `await client.close()` (or
    `async with`) closes them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._stubs: dict[int, pb_grpc.GenerationStub] = {}

    def _stub(self, index: int) -> pb_grpc.GenerationStub:
        if index not in self._stubs:
            self._channels[index] = self.connection.aio_channel(self.targets[index])
            self._stubs[index] = pb_grpc.GenerationStub(self._channels[index])
        return self._stubs[index]

    def generate(self, prompt: Prompt, params: GenerateParams | None = None, *, request_id: str | None = None,
                 timeout: float | None = None, api_key: str | None = None, **overrides) -> AsyncStream:
        return AsyncStream(self, self._stream_state(prompt, None, params, request_id, timeout, api_key, overrides))

    def chat(self, messages, params: GenerateParams | None = None, *, request_id: str | None = None,
             timeout: float | None = None, api_key: str | None = None, **overrides) -> AsyncStream:
        return AsyncStream(self, self._stream_state(None, messages, params, request_id, timeout, api_key, overrides))

    async def tokenize(self, text: str | None = None, *, messages=None,
                       add_generation_prompt: bool | None = None, tools=(), api_key: str | None = None) -> Tokens:
        request = self._tokenize_request(text, messages, add_generation_prompt, tools)
        reply = await self._unary("Tokenize", request, api_key)
        return Tokens(tuple(reply.token_ids), tuple(reply.tokens))

    async def model_info(self, api_key: str | None = None) -> ModelInfo:
        return ModelInfo.from_proto(await self._unary("GetModelInfo", pb.GetModelInfoRequest(), api_key))

    async def server_info(self, api_key: str | None = None) -> ServerInfo:
        return ServerInfo.from_proto(await self._unary("GetServerInfo", pb.GetServerInfoRequest(), api_key))

    async def health(self, timeout: float = 3.0) -> bool:
        """Whether some address reports `pagoda.v1.Generation` SERVING (grpc.health.v1)."""
        for index in range(len(self.targets)):
            self._stub(index)
            try:
                reply = await HealthStub(self._channels[index]).Check(HEALTH_REQUEST, timeout=timeout)
                if reply.status == SERVING:
                    return True
            except grpc.aio.AioRpcError:
                continue
        return False

    async def embed(self, inputs: EmbedInput, *, normalize: bool | None = None, dimensions: int | None = None,
              truncate_prompt_tokens: int | None = None, request_id: str | None = None, model: str = "",
              api_key: str | None = None, timeout: float | None = None) -> Embeddings:
        """Embed `inputs` (a text, texts, token ids or lists of them) with the served pooling model:
        one vector per input. `normalize` None follows the model; `dimensions` cuts a Matryoshka model's vectors."""
        req = embed_request(inputs, normalize=normalize, dimensions=dimensions, truncate_prompt_tokens=truncate_prompt_tokens,
                            request_id=request_id or uuid.uuid4().hex, model=model)
        return Embeddings.from_proto(await self._unary("Embed", req, api_key, timeout))

    async def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None, request_id: str | None = None,
               model: str = "", api_key: str | None = None, timeout: float | None = None) -> Reranked:
        """Score `documents` against `query` with the served cross-encoder (or embedding model): best first."""
        req = rerank_request(query, documents, top_n=top_n, request_id=request_id or uuid.uuid4().hex, model=model)
        return Reranked.from_proto(await self._unary("Rerank", req, api_key, timeout))

    async def abort(self, *request_ids: str, api_key: str | None = None) -> None:
        await self._unary("Abort", pb.AbortRequest(request_ids=request_ids), api_key)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, api_key: str | None = None,
                                timeout: float | None = None) -> None:
        request = pb.LoadLoraAdapterRequest(lora_name=lora_name, lora_path=lora_path)
        await self._unary("LoadLoraAdapter", request, api_key, timeout)

    async def unload_lora_adapter(self, lora_name: str, *, api_key: str | None = None) -> None:
        await self._unary("UnloadLoraAdapter", pb.UnloadLoraAdapterRequest(lora_name=lora_name), api_key)

    async def _unary(self, method: str, request, api_key: str | None = None, timeout: float | None = None):
        timeout, metadata = timeout or self.timeout, self._metadata(api_key)
        for attempt in range(self.retry.max_attempts):
            index = attempt % len(self.targets)
            try:
                return await getattr(self._stub(index), method)(request, timeout=timeout, metadata=metadata)
            except grpc.aio.AioRpcError as err:
                await asyncio.sleep(unary_retry_wait(err, attempt, self.retry, len(self.targets)))
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
