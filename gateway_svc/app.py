"""The FastAPI app: OpenAI's endpoints over one `AsyncClient`, plus /health and /metrics; the
models and LoRA adapters (`/v1/models`, what a request's `model` selects, vLLM's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`) are `models`.

A caller's `Authorization: Bearer <key>` is passed through to the scheduler as the gRPC
call's key, so the scheduler's `--api-key` decides who may call; `admission.Admission` checks
it before the body is read and bounds the body. Routes parse the body themselves, so every
problem with it is a 400 in OpenAI's shape naming the field (`schemas`). A caller that goes away
cancels its gRPC streams (streamed: when the next event cannot be sent; not streamed: the
gateway watches the connection while it waits), which aborts the requests on the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway_svc.admission import Admission, KeyVerdicts
from gateway_svc.agent_chat import ChatOptions
from gateway_svc.body import bearer, parse_body
from gateway_svc.disconnect import until_disconnected
from gateway_svc.errors import GatewayError, validation_error
from gateway_svc.messages import messages_router
from gateway_svc.metrics import GatewayMetrics
from gateway_svc.models import ModelName, models_router
from gateway_svc.pooling import pooling_router
from gateway_svc.response_store import ResponseStore
from gateway_svc.responses import responses_router
from gateway_svc.schemas import ChatCompletionRequest, CompletionRequest
from gateway_svc.tools import SPECIAL_TOKEN_PARSERS, ToolDeltas, read_output, structured
from gateway_svc.translate import (
    FINISH,
    Choice,
    chat_logprobs,
    chat_messages,
    chat_params,
    completion_logprobs,
    completion_params,
    completion_prompts,
    token_entries,
    usage_json,
)
from pagoda.client import AsyncClient, AsyncStream, Chunk, PagodaError
from pagoda.tool_parsers import DEFAULT_TOOL_PARSER, get_tool_parser

log = logging.getLogger("gateway_svc")

# gRPC's default receive limit, the scheduler's --max-request-bytes default.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


def _is_chat(request: Request) -> bool:
    return request.url.path.endswith("/chat/completions")


def _user(body) -> str:
    """`user` for the log: quoted (no raw newlines or escape codes) and at most 64 characters."""
    return repr(body.user[:64]) if body.user else "-"


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


async def _merged(streams: list[AsyncStream]) -> AsyncIterator[tuple[int, Chunk]]:
    """Chunks of several streams as they arrive, tagged with the stream's position."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncStream) -> None:
        try:
            async for chunk in stream:
                await queue.put((i, chunk))
        except BaseException as exc:  # handed to the consumer
            await queue.put(exc)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


def create_app(client: AsyncClient, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               reasoning_parser: str | None = None, tool_call_parser: str | None = None,
               response_store: ResponseStore | None = None) -> FastAPI:
    """`reasoning_parser`: sent with each chat (None: the scheduler's choice); `tool_call_parser`:
    the tool-call format (None: the scheduler's `ModelInfo.tool_call_parser`, else hermes);
    `response_store`: where `/v1/responses` keeps stored responses (None: in memory)."""
    app = FastAPI(title="Pagoda OpenAI-compatible gateway", docs_url=None, redoc_url=None)
    metrics = GatewayMetrics()
    app.add_middleware(Admission, verdicts=KeyVerdicts(client), max_request_bytes=max_request_bytes)
    app.add_middleware(metrics.middleware)  # outermost: counts the 401s and 413s too
    model = ModelName(client)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request, exc: GatewayError):
        return exc.response()

    @app.exception_handler(PagodaError)
    async def _pagoda_error(request, exc: PagodaError):
        constraint = getattr(request.state, "constraint_param", None)
        adapter = getattr(request.state, "adapter", None)
        return GatewayError.from_pagoda(exc, chat=_is_chat(request), constraint=constraint, model=adapter).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return validation_error(exc.errors()).response()

    @app.get("/health")
    async def health():
        if await client.health():
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    app.include_router(models_router(client))
    app.include_router(pooling_router(client, model))  # /v1/embeddings, /v1/rerank, /v1/score
    store = ResponseStore(":memory:") if response_store is None else response_store
    options = ChatOptions(reasoning_parser, tool_call_parser)
    app.include_router(responses_router(client, model, options, store))
    app.include_router(messages_router(client, model, options))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        key = bearer(request)
        name, request.state.adapter = await model.select(body.model, key)
        output = structured(body)
        request.state.constraint_param = output.param
        params = completion_params(body, output.params, request.state.adapter)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = [client.generate(p, params, request_id=f"{rid}-{i}", api_key=key)
                   for i, p in enumerate(completion_prompts(body))]
        log.info("%s: %d prompt(s), n=%d, user=%s", rid, len(streams), body.n, _user(body))
        created = int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": name}
        logprobs = body.logprobs is not None

        if body.stream:
            offsets: dict[int, int] = {}

            def event(i: int, chunk: Chunk) -> dict:
                index = i * body.n + chunk.index
                choice = {"index": index, "text": chunk.text, "logprobs": None,
                          "finish_reason": FINISH.get(chunk.finish_reason)}
                if logprobs:
                    choice["logprobs"] = completion_logprobs(token_entries(chunk), offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(chunk.text)
                return {**head, "choices": [choice]}

            return await _event_stream(streams, event, head, body.include_usage, chat=False)

        async def collect() -> dict:
            choices: dict[int, Choice] = {}
            async for i, chunk in _merged(streams):
                index = i * body.n + chunk.index
                choices.setdefault(index, Choice(index)).add(chunk, logprobs)
            out = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                    "logprobs": completion_logprobs(c.entries, 0) if logprobs else None}
                   for c in (choices[k] for k in sorted(choices))]
            return {**head, "choices": out, "usage": usage_json([s.usage for s in streams])}

        return await until_disconnected(request, collect())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse_body(request, ChatCompletionRequest)
        key = bearer(request)
        name, request.state.adapter = await model.select(body.model, key)
        parser = get_tool_parser(tool_call_parser or (model.info and model.info.tool_call_parser) or DEFAULT_TOOL_PARSER)
        output = structured(body, parser)
        request.state.constraint_param = output.param
        params = chat_params(body, output.params, request.state.adapter, reasoning_parser,
                             special_tokens=bool(output.mode) and parser.name in SPECIAL_TOKEN_PARSERS)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = client.chat(chat_messages(body), params, tools=output.tools, request_id=rid, api_key=key)
        log.info("%s: %d message(s), n=%d, user=%s", rid, len(body.messages), body.n, _user(body))
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": name}

        if body.stream:
            chunk_head = {**head, "object": "chat.completion.chunk"}
            opened: set[int] = set()
            tool_deltas: dict[int, ToolDeltas] = {}

            def event(_: int, chunk: Chunk) -> dict:
                finish = FINISH.get(chunk.finish_reason)
                delta = {"content": chunk.text} if chunk.text else {}
                if output.mode:
                    calls = tool_deltas.setdefault(chunk.index, ToolDeltas(output, body.parallel_tool_calls))
                    delta = calls.add(chunk.text, finish is not None)
                    finish = "tool_calls" if finish == "stop" and calls.num_calls else finish
                if chunk.reasoning_text and body.include_reasoning:
                    delta = {"reasoning_content": chunk.reasoning_text, "reasoning": chunk.reasoning_text, **delta}
                if chunk.index not in opened:
                    opened.add(chunk.index)
                    delta = {"role": "assistant", "content": None if output.mode else chunk.text, **delta}
                choice = {"index": chunk.index, "delta": delta, "logprobs": None, "finish_reason": finish}
                if body.logprobs:
                    choice["logprobs"] = chat_logprobs(token_entries(chunk))
                return {**chunk_head, "choices": [choice]}

            return await _event_stream([stream], event, chunk_head, body.include_usage, chat=True)

        async def collect() -> dict:
            choices: dict[int, Choice] = {}
            async for chunk in stream:
                choices.setdefault(chunk.index, Choice(chunk.index)).add(chunk, body.logprobs)
            out = [_chat_choice(c, *read_output(output, c.text, body.parallel_tool_calls), body.logprobs,
                                body.include_reasoning)
                   for c in (choices[k] for k in sorted(choices))]
            return {**head, "choices": out, "usage": usage_json([stream.usage])}

        return await until_disconnected(request, collect())

    return app


def _chat_choice(c: Choice, content: str | None, tool_calls: list[dict], logprobs: bool, reasoning: bool) -> dict:
    message = {"role": "assistant", "content": content if content or not c.reasoning else None}  # vLLM's null
    if c.reasoning and reasoning:  # vLLM's field, and its newer name
        message["reasoning_content"] = message["reasoning"] = c.reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": c.index, "message": message, "logprobs": chat_logprobs(c.entries) if logprobs else None,
            "finish_reason": "tool_calls" if tool_calls and c.finish_reason == "stop" else c.finish_reason}


async def _event_stream(streams: list[AsyncStream], event, head: dict, include_usage: bool, chat: bool) -> Response:
    """An SSE response; an error before the first chunk is an ordinary error response (with
    its HTTP status), one after it an `error` event, as OpenAI's clients expect."""
    chunks = _merged(streams)
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = None

    async def body() -> AsyncIterator[str]:
        try:
            if first is not None:
                yield _sse(event(*first))
                async for item in chunks:
                    yield _sse(event(*item))
            if include_usage:
                yield _sse({**head, "choices": [], "usage": usage_json([s.usage for s in streams])})
        except PagodaError as exc:
            yield _sse(GatewayError.from_pagoda(exc, chat=chat).body())
        finally:
            await chunks.aclose()
        yield _sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
