"""`vllm.grpc.engine.VllmEngine` (smg-grpc-proto's `vllm_engine.proto`) over Pagoda's Engine.

Served on the scheduler's gRPC port beside `pagoda.v1.Generation`, behind the same API keys,
TLS and message limits (the server's interceptor and options cover both), so SMG's router
(`smg launch --backend vllm --worker-urls grpc://...`) and clients written for `vllm serve
--grpc` use Pagoda unchanged. The shape follows vLLM's own servicer
(`smg_grpc_servicer.vllm.servicer`):

    Generate           tokenized (or text) input -> chunks / completes (responses.py), as
                       Pagoda's Generate runs it: same validation, tokenizer threads, tenant
                       salt, engine.submit; a cancelled call aborts the request. Images:
                       media_refs or mm_inputs beside tokenized input (media.py)
    Abort              engine.abort per id (idempotent)
    HealthCheck        healthy while an executor serves and the scheduler is not draining
    GetModelInfo       the model's facts; tokenizer_path is the scheduler's own directory
    GetServerInfo      block_size, kv_cache_dtype "auto", max_num_seqs over all executors, the
                       reasoning parser and where a constraint starts (requests.grammar_start), a
                       vision-language model's mm_processor "inprocess" (media_refs taken), ...
    GetLoads           one SchedulerLoad (rank 0) from loads.py
    GetTokenizer       the tokenizer files as SMG's zip bundle, 64 KiB chunks, sha256 on the last
    FlushCache         empty every executor's prefix cache once the scheduler is idle (admin keys only)
    SubscribeKvEvents  the prefix caches' blocks (kv_events.py), the load record on each batch
                       and as heartbeats (smg_grpc_servicer.load_record, SMG's own pacing)
    Embed              a pooling model (--runner pooling): one input through pagoda.v1's Embed
    StartProfile, StopProfile   UNIMPLEMENTED, saying why
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

import grpc
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_servicer.load_record import HEARTBEAT_INTERVAL, LoadRecorder
from smg_grpc_servicer.tokenizer_bundle import tokenizer_bundle, tokenizer_chunks

from pagoda import __version__
from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.auth import caller_is_admin, current_tenant, prefix_cache_salt
from scheduler_svc.client_stream import ClientStream
from scheduler_svc.engine import Engine
from scheduler_svc.errors import ServiceError
from scheduler_svc.tokenizer import ModelSpec
from scheduler_svc.validation import GenerateParams
from scheduler_svc.vllm_engine.kv_events import FellBehind, KvEventHub, OutOfRange
from scheduler_svc.vllm_engine.loads import LoadReader
from scheduler_svc.vllm_engine.media import media_ref_schemes, request_media
from scheduler_svc.vllm_engine.requests import constrained_decoding_start, to_pagoda_request, vllm_field_error
from scheduler_svc.vllm_engine.responses import ResponseTranslator

log = logging.getLogger(__name__)


class Admission(Protocol):
    """pagoda.v1's admission (`scheduler_svc.server.GenerationServicer.submit`): validation,
    tokenization, the constraint's compile check and the tenant's cache salt, then `engine.submit`."""

    async def submit(self, request: pb.GenerateRequest, media=None) -> tuple[GenerateParams, ClientStream]: ...

    async def embed(self, request: pb.EmbedRequest) -> pb.EmbedResponse: ...

    reasoning_parser: str  # the scheduler's --reasoning-parser ("" none), as chosen at start-up

SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
# What a FlushCache with timeout_s 0 waits at most (vLLM's servicer bounds its one attempt alike).
FLUSH_RETRY_S = 0.05
# The longest FlushCache waits for the scheduler to go idle: a longer wait holds an RPC (and
# retries every FLUSH_RETRY_S) for nothing a caller cannot do by calling again.
MAX_FLUSH_TIMEOUT_S = 60.0


class VllmEngineServicer(vpb_grpc.VllmEngineServicer):
    def __init__(
        self, engine: Engine, spec: ModelSpec, model_name: str, model_dir: Path | str | None, admission: Admission,
        kv_events: KvEventHub,
    ):
        """`model_dir`: the tokenizer's directory (None: GetTokenizer fails); `admission`: the Generation
        servicer's (one tokenizer pool, one constraint checker, one tenant rule); `kv_events`: fed by `engine.on_kv_events`."""
        self.engine = engine
        self.spec = spec
        self.model_name = model_name
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.admission = admission
        self.kv_events = kv_events
        self.loads = LoadReader(engine)
        self.start_time = time.time()
        self.last_receive_time = 0.0
        self._config = _read_config(self.model_dir) if self.model_dir is not None else {}

    # ---- generation ---------------------------------------------------------------------

    async def Generate(self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.last_receive_time = time.time()
        max_model_len = self.engine.config.max_model_len
        try:
            media = request_media(request)  # the images (media_refs or mm_inputs), checked before the rest
            params, stream = await self.admission.submit(
                to_pagoda_request(request, max_model_len, self.admission.reasoning_parser), media
            )
        except ServiceError as exc:
            exc = vllm_field_error(exc, request)
            await context.abort(exc.code, exc.message)
            return
        log.info(
            "request %s (vllm.grpc.engine): %d prompt tokens, n=%d", params.request_id, len(params.prompt_token_ids), params.n
        )
        sampling = request.sampling_params
        translator = ResponseTranslator(
            stream=request.stream,
            logprobs=sampling.HasField("logprobs"),
            top_logprobs=sampling.logprobs if sampling.HasField("logprobs") else 0,
        )
        try:
            async for response in stream.responses():
                for out in translator.translate(response):
                    yield out
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)
        finally:
            if not stream.done:  # the client cancelled or its deadline passed
                log.info("request %s cancelled by the client", params.request_id)
                self.engine.abort(params.request_id)

    async def Abort(self, request: vpb.AbortRequest, context) -> vpb.AbortResponse:
        for request_id in request.request_ids:
            self.engine.abort(request_id)
        return vpb.AbortResponse()

    async def Embed(self, request: vpb.EmbedRequest, context) -> vpb.EmbedResponse:
        """One input (its token ids, else its text) through pagoda.v1's Embed: the same checks and
        tokenizer, the model's own normalization; field names are the protocol's."""
        self.last_receive_time = time.time()
        tokenized = request.tokenized
        req = pb.EmbedRequest(request_id=request.request_id)
        if tokenized.input_ids:
            req.token_ids.append(pb.TokenIds(ids=tokenized.input_ids))
        else:
            req.texts.append(tokenized.original_text)
        try:
            reply = await self.admission.embed(req)
        except ServiceError as exc:
            message = exc.message.replace("token_ids[0].ids", "tokenized.input_ids", 1).replace(
                "texts[0]", "tokenized.original_text", 1).replace("texts:", "tokenized:", 1)
            await context.abort(exc.code, message)
            return
        values = reply.embeddings[0].values
        return vpb.EmbedResponse(embedding=values, prompt_tokens=reply.usage.prompt_tokens, embedding_dim=len(values))

    # ---- facts and load -----------------------------------------------------------------

    async def HealthCheck(self, request, context) -> vpb.HealthCheckResponse:
        if self.engine.draining:
            return vpb.HealthCheckResponse(healthy=False, message="the scheduler is shutting down")
        if not self.engine.serving:
            return vpb.HealthCheckResponse(healthy=False, message="no executor is registered")
        return vpb.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(self, request, context) -> vpb.GetModelInfoResponse:
        config, spec = self._config, self.spec
        max_model_len = self.engine.config.max_model_len
        return vpb.GetModelInfoResponse(
            model_path=str(self.model_dir or ""),
            is_generation=self.engine.config.runner == "generate",
            max_context_length=max_model_len,
            vocab_size=spec.vocab_size,
            supports_vision=self._images() is not None,
            served_model_name=self.model_name,
            tokenizer_path=str(self.model_dir or ""),
            model_type=str(config.get("model_type", "")),
            architectures=[str(a) for a in config.get("architectures", [])],
            eos_token_ids=list(spec.eos_token_ids),
            pad_token_id=_token_id(config.get("pad_token_id")),
            bos_token_id=_token_id(config.get("bos_token_id")),
            max_req_input_len=max_model_len - 1,  # a prompt must leave room for one token
            default_sampling_params_json="",  # Pagoda applies no generation-config defaults: none to advertise
        )

    async def GetServerInfo(self, request, context) -> vpb.GetServerInfoResponse:
        engine = self.engine
        return vpb.GetServerInfoResponse(
            active_requests=len(engine.requests),
            is_paused=engine.draining,
            last_receive_timestamp=self.last_receive_time,
            uptime_seconds=time.time() - self.start_time,
            server_type="pagoda",
            data_parallel_size=1,  # the executors are balanced inside the scheduler
            kv_cache_dtype="auto",  # each executor's model dtype
            block_size=engine.config.block_size,
            max_num_seqs=engine.config.max_num_seqs * len(engine.pool.alive),
            engine_reasoning_parser=self.admission.reasoning_parser,
            constrained_decoding_start=constrained_decoding_start(self.admission.reasoning_parser),
            **self._media_facts(),
        )

    def _images(self):
        """The model's processor (`media.ImagePrompts`; None: a text model, or no processor in its folder)."""
        prompts = getattr(self.admission, "prompts", None)
        return getattr(prompts, "images", None)

    def _media_facts(self) -> dict:
        """A vision-language model's images: processed here from the router's media_refs (so SMG's
        auto mode sends them, not pixels of its own), the schemes fetched and the image limit."""
        if self._images() is None:
            return {}
        media = self.admission.prompts.media
        return {"mm_processor": "inprocess", "mm_processor_source": "default",
                "mm_media_ref_schemes": media_ref_schemes(media), "mm_item_limits": f"image={media.limit_images}"}

    async def GetLoads(self, request: vpb.GetLoadsRequest, context) -> vpb.GetLoadsResponse:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"dp_rank: this engine has one rank (0), got {request.dp_rank}"
            )
        # `include` names optional sections (disagg, queues, memory): Pagoda has none beyond the core
        return vpb.GetLoadsResponse(
            timestamp=datetime.now(timezone.utc).isoformat(),
            version=__version__,
            dp_rank_count=1,
            loads=[self.loads.scheduler_load()],
        )

    async def GetTokenizer(self, request, context):
        if self.model_dir is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "started without a tokenizer directory")
        try:
            data, sha256 = await tokenizer_bundle(self.model_dir)
        except OSError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"the tokenizer files cannot be read: {exc}")
            return
        for chunk in tokenizer_chunks(data, sha256):
            yield chunk

    # ---- the prefix cache ---------------------------------------------------------------

    async def FlushCache(self, request: common_pb2.FlushCacheRequest, context) -> common_pb2.FlushCacheResponse:
        if not caller_is_admin():
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "FlushCache empties every tenant's prefix cache: it needs an admin key "
                "(`key tenant admin` in --api-key-file)",
            )
        timeout_s = request.timeout_s
        if not (math.isfinite(timeout_s) and 0 <= timeout_s <= MAX_FLUSH_TIMEOUT_S):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s: must be in [0, {MAX_FLUSH_TIMEOUT_S:g}], got {timeout_s}"
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.engine.reset_prefix_cache():
                return common_pb2.FlushCacheResponse(success=True, message="every executor's prefix cache is empty")
            if time.monotonic() >= deadline:
                return common_pb2.FlushCacheResponse(
                    success=False,
                    message="requests are in flight: not flushed (timeout_s waits for the scheduler to go idle)",
                )
            await asyncio.sleep(FLUSH_RETRY_S)

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest, context):
        if not self.engine.config.enable_prefix_caching:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "prefix caching is off (--no-enable-prefix-caching): no KV events"
            )
        try:
            salt = prefix_cache_salt(current_tenant(), "")  # what this caller's VllmEngine requests get
            subscription = self.kv_events.subscribe(salt, request.start_sequence_number)
        except OutOfRange as exc:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))
            return
        recorder = LoadRecorder(self.loads.engine_load)
        await context.send_initial_metadata(())  # the router counts a subscription answered from here
        sent, last_load_only = False, 0.0
        try:
            while True:
                batch = await subscription.next(recorder.poll_timeout(HEARTBEAT_INTERVAL))
                if batch is not None:
                    out = common_pb2.KvEventBatch()
                    out.CopyFrom(batch)  # the batch is every subscriber's: the load record is this one's
                    sent = True
                    yield recorder.stamp(out)
                elif sent:
                    heartbeat = recorder.heartbeat()
                    if heartbeat is not None:
                        yield heartbeat
                elif request.load_records_before_first_batch and time.monotonic() - last_load_only >= HEARTBEAT_INTERVAL:
                    last_load_only = time.monotonic()  # until the first batch: load-only ones numbered 0
                    yield common_pb2.KvEventBatch(sequence_number=0, timestamp=time.time(), load=self._load_only())
        except FellBehind as exc:
            await context.abort(grpc.StatusCode.DATA_LOSS, f"{exc}: clear this worker and resubscribe from 0")
        finally:
            subscription.close()

    def _load_only(self) -> common_pb2.EngineLoad:
        record = self.loads.engine_load()
        record.load_only = True
        return record

    # ---- not served ---------------------------------------------------------------------

    async def StartProfile(self, request, context):
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "StartProfile: no profiler in this engine (bench/profile_step_loop.py profiles)"
        )

    async def StopProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StopProfile: no profiler in this engine")


def _read_config(model_dir: Path) -> dict:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config.get("text_config", config) | {k: v for k, v in config.items() if k in ("architectures", "model_type")}


def _token_id(value) -> int:
    """A config's token id (an int, a list whose first counts, or none: -1)."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else -1


def add_vllm_engine(
    server: grpc.aio.Server, engine: Engine, spec: ModelSpec, model_name: str, model_dir: Path | str | None,
    admission: Admission,
) -> None:
    """Serve VllmEngine on `server`, its KV events fed by `engine` (which it subscribes to)."""
    hub = KvEventHub(engine.config.block_size)
    engine.on_kv_events = hub.publish
    servicer = VllmEngineServicer(engine, spec, model_name, model_dir, admission, hub)
    vpb_grpc.add_VllmEngineServicer_to_server(servicer, server)
