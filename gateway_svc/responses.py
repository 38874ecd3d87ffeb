"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request is a chat completion in other words (`agent_chat`): `instructions` is a first system
message, `input` (a text, or items: messages with `input_text` / `output_text` parts,
`function_call`, `function_call_output`) the messages after the stored conversation that
`previous_response_id` names; function `tools`, `tool_choice`, `parallel_tool_calls`,
`text.format` (json_schema / json_object: the gateway's structured output), `max_output_tokens`,
`temperature`, `top_p` are chat's fields. The answer is the same as chat completions', given as
output items (a `reasoning` item holding the reasoning parser's split, a `message` with one
`output_text`, `function_call`s), streamed as OpenAI's typed
events with a `sequence_number`. As OpenAI does, the earlier response's `instructions` are not
carried over, `reasoning` items of the input are not shown to the model, and an answer cut short
by `max_output_tokens` is `status: "incomplete"`.

`store` (default true) keeps the response and its conversation in the `ResponseStore`, per API
key: another key's id is 404 as an unknown one is.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, ValidationError

from gateway_svc.agent_chat import Answer, ChatOptions, ChatRun, Delta
from gateway_svc.body import bearer, parse_body
from gateway_svc.disconnect import until_disconnected
from gateway_svc.errors import GatewayError, validation_error
from gateway_svc.models import ModelName
from gateway_svc.response_store import ResponseStore, tenant_of
from gateway_svc.schemas import (MAX_MESSAGES, MAX_TOOLS, ChatCompletionRequest, Text, UINT32_MAX, _Strict)
from pagoda.client import AsyncClient, PagodaError, Usage


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: Text


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Strict):
    model: Text | None = None
    input: Text | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    stream: bool = False
    store: bool = True
    previous_response_id: Text | None = None
    metadata: dict[Text, Text] | None = Field(None, max_length=16)
    reasoning: dict[str, Any] | None = None
    user: Text | None = None
    truncation: Literal["disabled"] | None = None
    include: list[Text] | None = None
    background: Literal[False] | None = None
    service_tier: Text | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None


# -- input items to chat messages ----------------------------------------------------

_UNSUPPORTED_PARTS = ("input_file", "input_audio")


def _text_of(content, where: str, images: bool = False) -> str | list[dict]:
    """A message's content: a text, or parts of which the text ones are joined with newlines (as
    chat completions joins its text parts). With `images` (a user's or system's message), an
    `input_image` part's `image_url` (a `data:` URL, or a URL the scheduler's
    --allowed-media-domains allow) makes it chat's list of text and image_url parts, in order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}: must be a text or a list of content parts", param=where)
    texts, items = [], []
    for j, part in enumerate(content):
        param = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                why = "file_id is not served (no files API); " if part.get("file_id") else ""
                raise GatewayError(400, f"{param}.image_url: required, {why}a data: URL or an image's URL",
                                   param=f"{param}.image_url")
            items.append({"type": "image_url", "image_url": {"url": url}})
            continue
        if kind == "input_image" or kind in _UNSUPPORTED_PARTS:
            raise GatewayError(400, f"{param}: {kind} parts are not supported here; send input_text parts",
                               param=param)
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise GatewayError(400, f"{param}.type: must be input_text or output_text, got {kind!r}", param=param)
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise GatewayError(400, f"{param}.text: required, a string", param=f"{param}.text")
        texts.append(text)
        items.append({"type": "text", "text": text})
    if len(items) > len(texts):
        return items
    return "\n".join(texts)


def _required_str(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "output" and not value):
        raise GatewayError(400, f"{where}.{key}: required, a string", param=f"{where}.{key}")
    return value


def input_messages(given: str | list[dict]) -> list[dict]:
    """`input` as chat messages: a function_call joins the assistant turn before it (or opens
    one), a function_call_output is a "tool" message; reasoning items are left out."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise GatewayError(400, f"{where}.role: must be user, assistant, system or developer, got {role!r}",
                                   param=f"{where}.role")
            text = _text_of(item.get("content"), f"{where}.content", images=role != "assistant")
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name, arguments = _required_str(item, "name", where), _required_str(item, "arguments", where)
            try:
                json.loads(arguments)
            except ValueError:
                raise GatewayError(400, f"{where}.arguments: must be JSON text", param=f"{where}.arguments") from None
            call = {"id": _required_str(item, "call_id", where), "type": "function",
                    "function": {"name": name, "arguments": arguments}}
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _required_str(item, "call_id", where), "content": text})
        elif kind != "reasoning":
            raise GatewayError(400, f"{where}.type: must be message, function_call, function_call_output or "
                                    f"reasoning, got {kind!r}", param=f"{where}.type")
    return out


def chat_request(body: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat completion this request is: its errors name the chat fields, which
    `_responses_param` renames."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    chat: dict[str, Any] = {"model": body.model, "messages": [*system, *history],
                            "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
                            "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls, "user": body.user}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    if isinstance(body.tool_choice, NamedFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text else None
    if fmt and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_ or {}, "strict": fmt.strict}}
    elif fmt and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    if not chat["messages"]:
        raise GatewayError(400, "input: must hold at least one message", param="input")
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def _responses_param(param: str | None) -> str | None:
    """A chat field an error names, as this API's field."""
    if param is None:
        return None
    if param == "response_format":
        return "text.format"
    if param.startswith("tools[") and param.endswith("].function.parameters"):
        return param.replace(".function.parameters", ".parameters")
    return {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
            "messages": "input"}.get(param, param)


def _renamed(err: GatewayError) -> GatewayError:
    param = _responses_param(err.param)
    message = err.message
    if err.param and param != err.param and message.startswith(err.param):
        message = param + message[len(err.param):]
    return GatewayError(err.status, message, err.type, param, err.code)


# -- the response object and its items -------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [_part("message", text)] if status == "completed" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(answer: Answer) -> list[dict]:
    """A reasoning item (the reasoning parser's split), a message, function calls: those there are."""
    items = [reasoning_item(_id("rs"), answer.reasoning)] if answer.reasoning else []
    items += [message_item(_id("msg"), answer.content)] if answer.content else []
    return items + [call_item(_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"])
                    for c in answer.tool_calls]


def usage_object(usage: Usage | None) -> dict:
    prompt, completion, cached, reasoning = (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens,
                                             usage.reasoning_tokens) if usage else (0, 0, 0, 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def response_object(rid: str, created: float, body: ResponsesRequest, name: str, status: str,
                    output: list[dict], finish: str | None = None, usage: Usage | None = None) -> dict:
    fmt = body.text.format if body.text and body.text.format else None
    tool_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction) else body.tool_choice
    incomplete = status == "completed" and finish == "length"
    return {
        "id": rid, "object": "response", "created_at": created, "model": name,
        "status": "incomplete" if incomplete else status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "output": output, "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning or {"effort": None, "summary": None},
        "store": body.store, "temperature": body.temperature, "top_p": body.top_p,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "truncation": "disabled", "user": body.user, "metadata": body.metadata or {},
        "usage": usage_object(usage) if status != "in_progress" else None,
    }


def assistant_turn(output: list[dict]) -> list[dict]:
    """The response's output as the assistant message that continues its conversation."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


# -- streaming ---------------------------------------------------------------------------


class EventWriter:
    """OpenAI's streamed events of one response, numbered by `sequence_number`: a reasoning item
    and a message item each with one text part (`response.reasoning_text.*`,
    `response.output_text.*`), then one function_call item per call."""

    def __init__(self):
        self.sequence_number = 0
        self.output: list[dict] = []
        self._open: dict | None = None  # the reasoning or message item whose text streams now
        self._text = ""
        self._calls: dict[int, dict] = {}  # the open function_call items by tool-call index

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def _stream_text(self, kind: str, text: str) -> list[str]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close_text()
            item = message_item(_id("msg"), "", "in_progress") if kind == "message" else \
                reasoning_item(_id("rs"), "", "in_progress")
            self._open, self._text = item, ""
            self.output.append(item)
            index = len(self.output) - 1
            events.append(self.event("response.output_item.added", output_index=index, item=item))
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part=_part(kind, "")))
        self._text += text
        item = self._open
        events.append(self.event(f"{_EVENT[kind]}.delta", item_id=item["id"], output_index=self.output.index(item),
                                 content_index=0, delta=text, **_LOGPROBS[kind]))
        return events

    def delta(self, delta: Delta) -> list[str]:
        events = self._stream_text("reasoning", delta.reasoning) if delta.reasoning else []
        if delta.text:
            events += self._stream_text("message", delta.text)
        for piece in delta.tool_calls:
            if piece.index not in self._calls:
                events += self._close_text()
                item = call_item(_id("fc"), piece.id, piece.name, "", "in_progress")
                self._calls[piece.index] = item
                self.output.append(item)
                events.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                         item=dict(item)))
            item = self._calls[piece.index]
            if piece.arguments:
                item["arguments"] += piece.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=self.output.index(item), delta=piece.arguments))
        return events

    def _close_text(self) -> list[str]:
        if self._open is None:
            return []
        item, text, self._open = self._open, self._text, None
        kind, index = item["type"], self.output.index(item)
        done = message_item(item["id"], text) if kind == "message" else reasoning_item(item["id"], text)
        self.output[index] = done
        return [self.event(f"{_EVENT[kind]}.done", item_id=item["id"], output_index=index, content_index=0,
                           text=text, **_LOGPROBS[kind]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=_part(kind, text)),
                self.event("response.output_item.done", output_index=index, item=done)]

    def close(self) -> list[str]:
        events = self._close_text()
        for item in self._calls.values():
            index = self.output.index(item)
            item["status"] = "completed"
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        self._calls = {}
        return events


_EVENT = {"message": "response.output_text", "reasoning": "response.reasoning_text"}
_LOGPROBS = {"message": {"logprobs": []}, "reasoning": {}}


def _part(kind: str, text: str) -> dict:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


# -- the routes ----------------------------------------------------------------------------


def responses_router(client: AsyncClient, model: ModelName, options: ChatOptions, store: ResponseStore) -> APIRouter:
    router = APIRouter()

    def not_found(response_id: str, param: str | None = None) -> GatewayError:
        what = "Previous response" if param else "Response"
        return GatewayError(404, f"{what} with id '{response_id}' not found.", param=param,
                            code="previous_response_not_found" if param else None)

    @router.post("/v1/responses")
    async def create(request: Request):
        body = await parse_body(request, ResponsesRequest)
        key = bearer(request)
        tenant = tenant_of(key)
        history: list[dict] = []
        if body.previous_response_id is not None:
            previous = store.get(tenant, body.previous_response_id)
            if previous is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            history = previous.history
        history = history + input_messages(body.input)
        try:
            run, name = await ChatRun.start(client, model, options, chat_request(body, history), key, "resp")
        except GatewayError as err:
            raise _renamed(err) from None
        rid, created = _id("resp"), time.time()

        def finish(output: list[dict]) -> dict:
            response = response_object(rid, created, body, name, "completed", output, run.finish, run.usage)
            if body.store:
                store.put(tenant, response, history + assistant_turn(output))
            return response

        if not body.stream:
            async def collect() -> dict:
                try:
                    answer = await run.answer()
                except PagodaError as err:
                    raise _renamed(GatewayError.from_pagoda(err, chat=True, constraint=run.output.param)) from None
                return finish(output_items(answer))

            return await until_disconnected(request, collect())

        writer = EventWriter()
        deltas = run.deltas()
        try:
            first = await anext(deltas, None)
        except PagodaError as err:
            raise _renamed(GatewayError.from_pagoda(err, chat=True, constraint=run.output.param)) from None

        async def events() -> AsyncIterator[str]:
            started = response_object(rid, created, body, name, "in_progress", [])
            yield writer.event("response.created", response=started)
            yield writer.event("response.in_progress", response=started)
            try:
                if first is not None:
                    for e in writer.delta(first):
                        yield e
                    async for delta in deltas:
                        for e in writer.delta(delta):
                            yield e
            except PagodaError as exc:
                err = _renamed(GatewayError.from_pagoda(exc, chat=True, constraint=run.output.param))
                yield writer.event("error", code=err.code, message=err.message, param=err.param)
                return
            finally:
                await deltas.aclose()
            for e in writer.close():
                yield e
            yield writer.event("response.completed", response=finish(writer.output))

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @router.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str):
        stored = store.get(tenant_of(bearer(request)), response_id)
        if stored is None:
            raise not_found(response_id)
        return stored.response

    @router.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str):
        if not store.delete(tenant_of(bearer(request)), response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router
