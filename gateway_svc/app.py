"""The FastAPI app: OpenAI's endpoints over one `AsyncClient`, plus /health and /metrics.

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
from pydantic import BaseModel, ValidationError

from gateway_svc.admission import Admission, KeyVerdicts, bearer_key
from gateway_svc.errors import GatewayError, invalid_json, validation_error
from gateway_svc.metrics import GatewayMetrics
from gateway_svc.schemas import ChatCompletionRequest, CompletionRequest
from gateway_svc.tools import ToolDeltas, read_output, structured
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

log = logging.getLogger("gateway_svc")

_DISCONNECT_POLL_S = 0.25
# gRPC's default receive limit, the scheduler's --max-request-bytes default.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


def _bearer(request: Request) -> str | None:
    return bearer_key(request.scope)  # checked by Admission: printable ASCII


def _is_chat(request: Request) -> bool:
    return request.url.path.endswith("/chat/completions")


async def _parse(request: Request, model: type[BaseModel]):
    """The request body as `model`; a body that is not JSON, or not a valid `model`, is a 400
    naming the position or the field, and a field not supported yet is a 400 naming it."""
    try:
        data = json.loads(await request.body())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise invalid_json(exc) from None
    except RecursionError:
        raise GatewayError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    if field := body.unsupported():
        raise GatewayError(400, f"{field}: not supported by this server yet", param=field, code="unsupported_parameter")
    return body


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


async def _until_disconnected(request: Request, coro):
    """Await `coro`, cancelling it (and so its gRPC calls) if the caller disconnects."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                log.info("caller disconnected: request cancelled")
                return Response(status_code=499)
    finally:
        task.cancel()


class ModelName:
    """The name GetModelInfo reports, asked once (with the first caller's key) and kept."""

    def __init__(self, client: AsyncClient):
        self._client = client
        self._name: str | None = None

    async def get(self, api_key: str | None) -> str:
        if self._name is None:
            self._name = (await self._client.model_info(api_key=api_key)).name
        return self._name

    async def check(self, requested: str | None, api_key: str | None) -> str:
        name = await self.get(api_key)
        if requested and requested != name:
            raise GatewayError(404, f"The model `{requested}` does not exist; this server serves `{name}`",
                               param="model", code="model_not_found")
        return name


def create_app(client: AsyncClient, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
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
        return GatewayError.from_pagoda(exc, chat=_is_chat(request), constraint=constraint).response()

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

    @app.get("/v1/models")
    async def models(request: Request):
        name = await model.get(_bearer(request))
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "pagoda"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest)
        key = _bearer(request)
        name = await model.check(body.model, key)
        output = structured(body)
        request.state.constraint_param = output.param
        params = completion_params(body, output.params)
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

        return await _until_disconnected(request, collect())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatCompletionRequest)
        key = _bearer(request)
        name = await model.check(body.model, key)
        output = structured(body)
        request.state.constraint_param = output.param
        params = chat_params(body, output.params)
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
            out = [_chat_choice(c, *read_output(output, c.text, body.parallel_tool_calls), body.logprobs)
                   for c in (choices[k] for k in sorted(choices))]
            return {**head, "choices": out, "usage": usage_json([stream.usage])}

        return await _until_disconnected(request, collect())

    return app


def _chat_choice(c: Choice, content: str | None, tool_calls: list[dict], logprobs: bool) -> dict:
    message = {"role": "assistant", "content": content}
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
