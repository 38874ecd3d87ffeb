"""`Client`: the blocking client over grpcio (the same behaviour as `AsyncClient`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence

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


class Stream(StreamView):
    """Iterate for `Chunk`s; `usage` is set once the stream has ended. Breaking out of the loop
    (or `close()`) cancels the request, which frees its KV blocks on the server."""

    def __init__(self, client: Client, state: StreamAttempts):
        super().__init__(state)
        self._client = client
        self._iter = self._run()

    def __iter__(self) -> Iterator[Chunk]:
        return self._iter

    def __next__(self) -> Chunk:
        return next(self._iter)

    def close(self) -> None:
        self._iter.close()

    def collect(self) -> Completion:
        return Completion.join(self.request_id, list(self), self.usage)

    def _run(self) -> Iterator[Chunk]:
        state, client = self._state, self._client
        while True:
            call = None
            try:
                stub = client._stub(state.target())
                if state.needs_prompt_ids():
                    reply = stub.Tokenize(state.tokenize_request(), timeout=state.timeout(), metadata=state.metadata)
                    state.set_prompt_ids(list(reply.token_ids))
                call = stub.Generate(state.next_request(), timeout=state.timeout(), metadata=state.metadata)
                for msg in call:
                    yield from state.accept(msg)
                if state.complete():
                    return
                wait = state.on_error(None)
            except grpc.RpcError as err:
                wait = state.on_error(err)
            finally:
                if call is not None:
                    call.cancel()  # no-op when it ended; frees the request when the caller stopped early
            time.sleep(wait)


class Client(ClientBase):
    """Blocking Pagoda client. `with Client("127.0.0.1:50051") as c: print(c.generate("Hi").collect().text)`"""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._channels: dict[int, grpc.Channel] = {}
        self._stubs: dict[int, pb_grpc.GenerationStub] = {}

    def _stub(self, index: int) -> pb_grpc.GenerationStub:
        if index not in self._stubs:
            self._channels[index] = self.connection.channel(self.targets[index])
            self._stubs[index] = pb_grpc.GenerationStub(self._channels[index])
        return self._stubs[index]

    def generate(self, prompt: Prompt, params: GenerateParams | None = None, *, request_id: str | None = None,
                 timeout: float | None = None, api_key: str | None = None, **overrides) -> Stream:
        """Stream a completion of `prompt` (text or token ids); keyword overrides of `params`,
        e.g. `generate("Hi", max_tokens=16, temperature=0)`."""
        return Stream(self, self._stream_state(prompt, None, params, request_id, timeout, api_key, overrides))

    def chat(self, messages, params: GenerateParams | None = None, *, request_id: str | None = None,
             timeout: float | None = None, api_key: str | None = None, **overrides) -> Stream:
        """Stream the assistant's answer to `messages` (the model's chat template is applied)."""
        return Stream(self, self._stream_state(None, messages, params, request_id, timeout, api_key, overrides))

    def tokenize(self, text: str | None = None, *, messages=None, add_generation_prompt: bool | None = None, tools=(),
                 api_key: str | None = None) -> Tokens:
        reply = self._unary("Tokenize", self._tokenize_request(text, messages, add_generation_prompt, tools), api_key)
        return Tokens(tuple(reply.token_ids), tuple(reply.tokens))

    def model_info(self, api_key: str | None = None) -> ModelInfo:
        return ModelInfo.from_proto(self._unary("GetModelInfo", pb.GetModelInfoRequest(), api_key))

    def server_info(self, api_key: str | None = None) -> ServerInfo:
        return ServerInfo.from_proto(self._unary("GetServerInfo", pb.GetServerInfoRequest(), api_key))

    def health(self, timeout: float = 3.0) -> bool:
        """Whether some address reports `pagoda.v1.Generation` SERVING (grpc.health.v1)."""
        for index in range(len(self.targets)):
            self._stub(index)
            try:
                if HealthStub(self._channels[index]).Check(HEALTH_REQUEST, timeout=timeout).status == SERVING:
                    return True
            except grpc.RpcError:
                continue
        return False

    def embed(self, inputs: EmbedInput, *, normalize: bool | None = None, dimensions: int | None = None,
              truncate_prompt_tokens: int | None = None, request_id: str | None = None, model: str = "",
              api_key: str | None = None, timeout: float | None = None) -> Embeddings:
        """Embed `inputs` (a text, texts, token ids or lists of them) with the served pooling model:
        one vector per input. `normalize` None follows the model; `dimensions` cuts a Matryoshka model's vectors."""
        req = embed_request(inputs, normalize=normalize, dimensions=dimensions, truncate_prompt_tokens=truncate_prompt_tokens,
                            request_id=request_id or uuid.uuid4().hex, model=model)
        return Embeddings.from_proto(self._unary("Embed", req, api_key, timeout))

    def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None, request_id: str | None = None,
               model: str = "", api_key: str | None = None, timeout: float | None = None) -> Reranked:
        """Score `documents` against `query` with the served cross-encoder (or embedding model): best first."""
        req = rerank_request(query, documents, top_n=top_n, request_id=request_id or uuid.uuid4().hex, model=model)
        return Reranked.from_proto(self._unary("Rerank", req, api_key, timeout))

    def abort(self, *request_ids: str, api_key: str | None = None) -> None:
        self._unary("Abort", pb.AbortRequest(request_ids=request_ids), api_key)

    def load_lora_adapter(self, lora_name: str, lora_path: str, *, api_key: str | None = None,
                          timeout: float | None = None) -> None:
        """Load the LoRA adapter at `lora_path` (a PEFT folder on the scheduler's host, or ORG/NAME
        on the Hugging Face hub) as `lora_name` on every executor; requests then select it with
        `model=lora_name`. A bad adapter raises the scheduler's status naming the field
        (InvalidArgument, NotFound, FailedPrecondition) and nothing is loaded."""
        request = pb.LoadLoraAdapterRequest(lora_name=lora_name, lora_path=lora_path)
        self._unary("LoadLoraAdapter", request, api_key, timeout)

    def unload_lora_adapter(self, lora_name: str, *, api_key: str | None = None) -> None:
        """Unload the LoRA adapter `lora_name`: requests in flight with it finish, new ones naming it
        are NotFound."""
        self._unary("UnloadLoraAdapter", pb.UnloadLoraAdapterRequest(lora_name=lora_name), api_key)

    def _unary(self, method: str, request, api_key: str | None = None, timeout: float | None = None):
        timeout, metadata = timeout or self.timeout, self._metadata(api_key)
        for attempt in range(self.retry.max_attempts):
            index = attempt % len(self.targets)
            try:
                return getattr(self._stub(index), method)(request, timeout=timeout, metadata=metadata)
            except grpc.RpcError as err:
                time.sleep(unary_retry_wait(err, attempt, self.retry, len(self.targets)))
        raise AssertionError("unreachable")

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
        self._stubs.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
