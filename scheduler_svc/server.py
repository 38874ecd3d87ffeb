"""The gRPC adapter: pagoda.v1.Generation, vllm.grpc.engine.VllmEngine (scheduler_svc/vllm_engine),
grpc.health.v1 and server reflection over the Engine.

API keys and TLS (scheduler_svc/auth.py) wrap the server; health and reflection need no key.
Requests are parsed inside their handlers (scheduler_svc/request_decoding.py), after the key
check: a message that does not parse is INVALID_ARGUMENT. A request is its caller's tenant's
(the engine keys it by (tenant, request_id)); `Generate` checks the tenant's share and the
queue before it tokenizes anything.

GetServerInfo shows every authenticated caller the server's totals (requests running and
waiting, KV blocks, per executor), never a request id, a tenant or one tenant's load: what
a router needs to balance load (vLLM's /load and /metrics and SGLang's /get_load show the
same to any caller), and nothing one tenant can learn about another's requests from it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagoda.reasoning import constrain_after_reasoning, get_reasoning_parser
from pagoda.v1 import generation_pb2 as pb
from pagoda.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.auth import ApiKey, ApiKeyInterceptor, current_tenant
from scheduler_svc.client_stream import ClientStream
from scheduler_svc.constraint_check import ConstraintChecker
from scheduler_svc.media import MediaConfig
from scheduler_svc.engine import Engine
from scheduler_svc.errors import InvalidArgument, ServiceError
from scheduler_svc.lora_registry import FailedPrecondition, NotFound
from scheduler_svc.pooling_requests import PoolingFrontEnd
from scheduler_svc.pooling_stream import PoolParams
from scheduler_svc.prompts import MAX_REPLY_BYTES, PromptWorker
from scheduler_svc.request_decoding import DecodeRequests
from scheduler_svc.tokenizer import ModelSpec
from scheduler_svc.validation import GenerateParams
from scheduler_svc.vllm_engine import SERVICE_NAME as VLLM_ENGINE_SERVICE
from scheduler_svc.vllm_engine import add_vllm_engine

log = logging.getLogger(__name__)

# prompt tokens decoded to see whether the prompt leaves a reasoning block open
_PROMPT_TAIL = 32

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(
        self, engine: Engine, spec: ModelSpec, model_name: str, model_dir: Path | str | None = None,
        pooling: PoolingFrontEnd | None = None, reasoning_parser: str = "", tool_call_parser: str = "",
        media: MediaConfig = MediaConfig(),
    ):
        """`model_dir`: the tokenizer's directory, for the child process that tokenizes huge texts (prompts.py);
        `pooling`: the pooling model's rules (--runner pooling: Embed and Rerank, no Generate);
        `reasoning_parser`: the split of chat prompts' outputs ("" none); `tool_call_parser`: reported in ModelInfo."""
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser
        self.engine = engine
        self.pooling = pooling
        self.spec = spec
        self.model_name = model_name
        self.prompts = PromptWorker(engine.tokenizer, spec, engine.config.max_model_len, model_dir=model_dir, media=media)
        self.constraints = ConstraintChecker(model_dir or engine.tokenizer.name_or_path)

    async def submit(self, request: pb.GenerateRequest, media=None) -> tuple[GenerateParams, ClientStream]:
        """Check the caller's share, validate and tokenize `request`, check its constraint compiles,
        then submit it under the caller's tenant; ServiceError (naming the field) before any work otherwise.

        The one admission path of both APIs (`vllm.grpc.engine` translates its requests to ours first;
        `media`: its images beside the token ids, `scheduler_svc.vllm_engine.media`).
        """
        if self.pooling is not None:
            raise InvalidArgument("model", f"{self.model_name!r} is a pooling model (--runner pooling): it serves Embed "
                                           f"and Rerank, not Generate")
        self.engine.check_admission()  # the tenant's share and the queue, before any work
        parser = self._reasoning_parser(request)
        lora = await self._adapter(request.model)
        if media is not None:
            params = await self.prompts.token_media_params(request, media)
        else:
            params = await self.prompts.generate_params(request)
        if lora:
            params = dataclasses.replace(params, lora=lora)
        if parser is not None:
            tail = self.engine.tokenizer.decode(params.prompt_token_ids[-_PROMPT_TAIL:], skip_special_tokens=False)
            params = dataclasses.replace(params, reasoning=(parser, parser.initial_state(tail)))
        if params.sampling.constraint is not None:
            # compiled once, here: the request carries the grammar to its executor (b"": it compiles it)
            grammar = await self.constraints.check(params.sampling.constraint, current_tenant())  # its turn among tenants
            constraint = params.sampling.constraint
            if parser is not None:  # the grammar starts once the reasoning ends
                constraint = constrain_after_reasoning(params.sampling.constraint, *params.reasoning)
                if constraint is not params.sampling.constraint:
                    grammar = await self.constraints.check(constraint, current_tenant())  # the one the executors run
            sampling = dataclasses.replace(params.sampling, constraint=constraint, compiled_grammar=grammar)
            params = dataclasses.replace(params, sampling=sampling)
        return params, self.engine.submit(params)  # under the caller's tenant (its cache salt too)

    def _reasoning_parser(self, request: pb.GenerateRequest):
        """The request's reasoning parser (None: no split); INVALID_ARGUMENT naming `reasoning_parser`."""
        name = request.reasoning_parser
        if not name:
            if request.WhichOneof("prompt") != "chat":
                return None
            name = self.reasoning_parser
        try:
            return get_reasoning_parser(name)
        except KeyError as exc:
            raise InvalidArgument("reasoning_parser", exc.args[0]) from None  # under the caller's tenant (its cache salt too)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            params, stream = await self.submit(request)
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)
            return
        log.info("request %r: %d prompt tokens, n=%d", params.request_id, len(params.prompt_token_ids), params.n)
        try:
            async for response in stream.responses():
                yield response
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)
        finally:
            if not stream.done:  # the client cancelled or its deadline passed
                log.info("request %r cancelled by the client", params.request_id)
                self.engine.abort(params.request_id, tenant=stream.tenant)

    async def embed(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        """Check the caller's share, validate and tokenize `request`, run it; ServiceError naming the field
        otherwise. The one Embed path of both APIs (`vllm.grpc.engine`'s Embed translates to it)."""
        pooling = self._pooling("Embed")
        self.engine.check_admission()  # the tenant's share and the queue, before any work
        await self._adapter(request.model)
        params = await self.prompts.run(pooling.embed_params, request)
        return pooling.embed_response(params, await self._pooled(params))

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        try:
            return await self.embed(request)
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)

    async def Rerank(self, request: pb.RerankRequest, context) -> pb.RerankResponse:
        try:
            pooling = self._pooling("Rerank")
            self.engine.check_admission()
            await self._adapter(request.model)
            params = await self.prompts.run(pooling.rerank_params, request)
            return pooling.rerank_response(request, params, await self._pooled(params))
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)

    def _pooling(self, rpc: str) -> PoolingFrontEnd:
        if self.pooling is None:
            raise InvalidArgument("model", f"{self.model_name!r} is a generation model; {rpc} needs a pooling model "
                                           f"(an embedding model or a cross-encoder, served with --runner pooling)")
        return self.pooling

    async def _pooled(self, params: PoolParams) -> list[list[float]]:
        """Submit a validated pooling request under the caller's tenant; every input's values.
        A cancelled call (the client left, its deadline passed) aborts it."""
        stream = self.engine.submit_pooling(params)
        try:
            return await stream.result()
        finally:
            if not stream.done:
                self.engine.abort(params.request_id, tenant=stream.tenant)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        for request_id in request.request_ids:
            self.engine.abort(request_id)
        return pb.AbortResponse()

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        try:
            return await self.prompts.tokenize(request)
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        return pb.ModelInfo(
            name=self.model_name,
            max_model_len=self.engine.config.max_model_len,
            vocab_size=self.spec.vocab_size,
            eos_token_ids=self.spec.eos_token_ids,
            block_size=self.engine.config.block_size,
            lora_adapters=self.engine.loras.names() if self.engine.loras is not None else [],
            reasoning_parser=self.reasoning_parser,
            tool_call_parser=self.tool_call_parser,
        )

    async def _adapter(self, model: str) -> str:
        """The adapter `GenerateRequest.model` names ("" for the base model); NOT_FOUND naming `model`."""
        if self.engine.loras is not None:
            return await self.engine.loras.acquire(model)
        if model and model != self.model_name:
            raise NotFound("model", f"{model!r} is not the served model ({self.model_name!r}); LoRA adapters are off (--enable-lora)")
        return ""

    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest, context) -> pb.LoadLoraAdapterResponse:
        try:
            await self._loras().load(request.lora_name, request.lora_path)
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)
        return pb.LoadLoraAdapterResponse()

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest, context) -> pb.UnloadLoraAdapterResponse:
        try:
            await self._loras().unload(request.lora_name)
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)
        return pb.UnloadLoraAdapterResponse()

    def _loras(self):
        if self.engine.loras is None:
            raise FailedPrecondition("LoRA adapters are off on this server (start the scheduler with --enable-lora)")
        return self.engine.loras

    async def GetServerInfo(self, request, context) -> pb.ServerInfo:
        return self.engine.server_info()


# gRPC's own default receive limit; every request must fit it (--max-request-bytes changes it).
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
# Streams one client connection may have open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS,
# --max-concurrent-streams), well under the server-wide backlog below.
DEFAULT_MAX_CONCURRENT_STREAMS = 256
# Calls gRPC holds before a handler takes them (its backlog). Past gRPC's default (1000, then
# refusing new calls of every connection at random, all past 3000) a flood over many connections
# got other tenants' calls CANCELLED (bench/stall_probe.py, 3,000 short streams over 15
# connections: the bystander's call at once in one run, 680 calls in another); past this many,
# calls are still refused. The handlers take them in arrival order and refuse the over-share
# ones (RESOURCE_EXHAUSTED) in well under a millisecond each.
MAX_PENDING_CALLS = 20_000


def grpc_options(
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS
) -> list[tuple[str, int]]:
    """Message size limits, explicit: a larger request is refused by gRPC (RESOURCE_EXHAUSTED).

    SO_REUSEPORT is off: with it (gRPC's default on Linux) a second scheduler on the same port
    would start without error and silently share the first one's connections.

    At most `max_concurrent_streams` streams per connection: a client's further calls wait in
    the client until one ends. gRPC's overload protection is off: it counts a stream until its
    memory is freed, after the client saw it end, so a client keeping to the limit would get
    some calls refused (UNAVAILABLE, REFUSED_STREAM). A client that ignores the limit still is.
    """
    return [
        ("grpc.max_receive_message_length", max_request_bytes),
        ("grpc.max_send_message_length", MAX_REPLY_BYTES),
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", max_concurrent_streams),
        ("grpc.http.overload_protection", 0),
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
    ]


async def build_server(
    engine: Engine,
    spec: ModelSpec,
    model_name: str,
    address: str,
    api_keys: list[ApiKey] = (),
    credentials: grpc.ServerCredentials | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    model_dir: Path | str | None = None,
    max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS,
    pooling: PoolingFrontEnd | None = None,
    reasoning_parser: str = "",
    tool_call_parser: str = "",
    media: MediaConfig = MediaConfig(),
) -> tuple[grpc.aio.Server, int]:
    """The server on `address`: API keys required when `api_keys`, TLS when `credentials`.

    The API-key interceptor comes first: a request without a key is refused unparsed.
    """
    keys = [ApiKeyInterceptor(list(api_keys))] if api_keys else []
    server = grpc.aio.server(
        interceptors=[*keys, DecodeRequests()], options=grpc_options(max_request_bytes, max_concurrent_streams)
    )
    generation = GenerationServicer(engine, spec, model_name, model_dir, pooling, reasoning_parser, tool_call_parser, media)
    pb_grpc.add_GenerationServicer_to_server(generation, server)
    add_vllm_engine(server, engine, spec, model_name, model_dir, generation)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, VLLM_ENGINE_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )

    def set_serving(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in (SERVICE_NAME, VLLM_ENGINE_SERVICE):
            asyncio.ensure_future(health_servicer.set(name, status))

    engine.on_health_change = set_serving
    for name in (SERVICE_NAME, VLLM_ENGINE_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    return server, port
