"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A request is a chat completion in other words (`agent_chat`): `system` (a text or text blocks) is
a first system message; a message's `text` blocks are its content, an assistant's `tool_use`
blocks its tool calls, a user's `tool_result` blocks "tool" messages (before the user's text, as
they answer the turn before); `tools` (`input_schema` as the parameters), `tool_choice` (`auto`,
`any` = required, `tool` = a named function, `none`; `disable_parallel_tool_use`),
`stop_sequences`, `max_tokens` (required, as Anthropic's), `temperature` / `top_p` / `top_k`.
`thinking` (enabled / disabled) is the chat template's `enable_thinking`. The answer is chat
completions' in Anthropic's blocks (`thinking` with the reasoning parser's split, `text`,
`tool_use` with the arguments as its `input` object), with `stop_reason` end_turn / max_tokens /
stop_sequence / tool_use, streamed as Anthropic's events (`message_start`, `ping`,
`content_block_start` / `_delta` (`thinking_delta`, `text_delta`, `input_json_delta`) / `_stop`,
`message_delta` with the stop reason and usage, `message_stop`).

The caller's key comes as `x-api-key` or as `Authorization: Bearer` (`admission.bearer_key`).
Every error is in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, with the
status Anthropic gives it. Image blocks go to the scheduler as the chat's image parts.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field, ValidationError

from gateway_svc.agent_chat import Answer, ChatOptions, ChatRun, Delta
from gateway_svc.body import bearer, parse_body
from gateway_svc.disconnect import until_disconnected
from gateway_svc.errors import GatewayError, validation_error
from gateway_svc.models import ModelName
from gateway_svc.schemas import (INT32_MAX, MAX_MESSAGES, MAX_STOP_STRINGS, MAX_TOOLS, UINT32_MAX,
                                 ChatCompletionRequest, Text, _Strict)
from gateway_svc.translate import chat_messages
from pagoda.client import AsyncClient, PagodaError, Usage

class Tool(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: Text | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)]


class CountTokensRequest(_Strict):
    model: Text | None = None
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Text | list[dict[str, Any]] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=UINT32_MAX)
    stop_sequences: Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: Text | None = None


# -- the request as chat messages --------------------------------------------------------


def _texts(blocks, where: str) -> str:
    """Text blocks joined (a tool_result's or system's content); anything else is a 400."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise GatewayError(400, f"{where}: must be a text or a list of text blocks", param=where)
    texts = []
    for j, block in enumerate(blocks):
        if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
            kind = block.get("type") if isinstance(block, dict) else None
            raise GatewayError(400, f"{where}.{j}: must be a text block, got {kind!r}", param=f"{where}.{j}")
        texts.append(block["text"])
    return "\n".join(texts)


def _message(i: int, m: Message) -> list[dict]:
    where = f"messages.{i}.content"
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts, calls, results, parts = [], [], [], []
    for j, block in enumerate(m.content):
        at, kind = f"{where}.{j}", block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and m.role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), f"{at}.source")}})
        elif kind == "document":
            raise GatewayError(400, f"{at}: document blocks are not supported; send text blocks", param=at)
        elif kind == "tool_use" and m.role == "assistant":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input"), dict)):
                raise GatewayError(400, f"{at}: a tool_use block needs id, name and an input object", param=at)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        elif kind == "tool_result" and m.role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise GatewayError(400, f"{at}.tool_use_id: required, a string", param=f"{at}.tool_use_id")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _texts(block.get("content", ""), f"{at}.content")})
        elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
            continue  # earlier thinking is not shown to the model again, as chat templates drop it
        else:
            raise GatewayError(400, f"{at}.type: {kind!r} is not a {m.role} block this server takes "
                                    f"(text, tool_use, tool_result)", param=f"{at}.type")
    out = results
    if len(parts) > len(texts):  # images: chat's parts in order (the scheduler sends them as ChatMessage.parts)
        out = [*out, {"role": m.role, "content": parts}]
    elif texts or calls or not results:
        out = [*out, {"role": m.role, "content": "\n".join(texts), **({"tool_calls": calls} if calls else {})}]
    return out


_IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def _image_url(source, where: str) -> str:
    """An image block's source as chat's image URL: {"type": "base64", "media_type", "data"} a
    `data:` URL, {"type": "url", "url"} the URL (fetched by the scheduler only from its
    --allowed-media-domains). The bytes are checked where they are decoded, by the scheduler."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in _IMAGE_MEDIA_TYPES:
            raise GatewayError(400, f"{where}.media_type: must be one of {', '.join(_IMAGE_MEDIA_TYPES)}, "
                                    f"got {media_type!r}", param=f"{where}.media_type")
        if not isinstance(data, str) or not data:
            raise GatewayError(400, f"{where}.data: required, the image's base64 text", param=f"{where}.data")
        return f"data:{media_type};base64,{data}"
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise GatewayError(400, f"{where}.url: required, a string", param=f"{where}.url")
        return url
    raise GatewayError(400, f"{where}.type: must be base64 or url, got {kind!r}", param=f"{where}.type")


def chat_messages_of(body: CountTokensRequest) -> list[dict]:
    system = [] if body.system is None else [{"role": "system", "content": _texts(body.system, "system")}]
    return system + [x for i, m in enumerate(body.messages) for x in _message(i, m)]


def _thinking_enabled(thinking: dict) -> bool:
    """Anthropic's `thinking` ({"type": "enabled", "budget_tokens": n}, {"type": "disabled"}) as
    the chat template's `enable_thinking` (Qwen 3's); the budget is not enforced."""
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise GatewayError(400, f"thinking.type: must be enabled or disabled, got {kind!r}", param="thinking.type")
    return kind != "disabled"


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    chat: dict[str, Any] = {"model": body.model, "messages": chat_messages_of(body)}
    if body.thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": _thinking_enabled(body.thinking)}
    if isinstance(body, MessagesRequest):
        chat.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                    top_p=body.top_p, top_k=body.top_k)
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise GatewayError(400, "tool_choice.name: required with type \"tool\"", param="tool_choice.name")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
        chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def _renamed(err: GatewayError) -> GatewayError:
    """A chat field an error names, as this API's field."""
    message = err.message
    for chat_name, name in (("max_completion_tokens", "max_tokens"), ("stop:", "stop_sequences:"),
                            (".function.parameters", ".input_schema")):
        message = message.replace(chat_name, name)
    return GatewayError(err.status, message, err.type, err.param, err.code)


# -- the answer in Anthropic's shape -----------------------------------------------------------

_STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(finish: str, matched_stop: str) -> str:
    return "stop_sequence" if matched_stop else _STOP_REASON[finish]


def usage_object(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """Anthropic's usage: `input_tokens` are the prompt's tokens not read from the prefix cache
    (`cache_read_input_tokens`); their sum is the chat completion's `prompt_tokens`."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def final_usage(usage: Usage | None) -> dict:
    return usage_object(usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens) if usage else \
        usage_object(0, 0, 0)


def _tool_input(arguments: str) -> dict | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def content_blocks(answer: Answer) -> list[dict]:
    """A thinking block (the reasoning parser's split), text, then tool_use blocks; a call whose
    arguments are no JSON object (cut short by max_tokens) is given as text, since tool_use's
    input must be an object."""
    thinking = [{"type": "thinking", "thinking": answer.reasoning, "signature": ""}] if answer.reasoning else []
    texts = [answer.content] if answer.content else []
    blocks = []
    for c in answer.tool_calls:
        tool_input = _tool_input(c["function"]["arguments"])
        if tool_input is None:
            texts.append(c["function"]["arguments"])
        else:
            blocks.append({"type": "tool_use", "id": f"toolu_{c['id'].removeprefix('call_')}",
                           "name": c["function"]["name"], "input": tool_input})
    return thinking + [{"type": "text", "text": t} for t in texts] + blocks


def message_object(mid: str, name: str, content: list[dict], reason: str | None, matched_stop: str,
                   usage: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": name, "content": content,
            "stop_reason": reason, "stop_sequence": matched_stop or None, "usage": usage}


class EventWriter:
    """Anthropic's streamed events of one message: a thinking block opened at the first reasoning
    (thinking_delta pieces), a text block at the first text, one tool_use block per call (its
    arguments as input_json_delta pieces)."""

    def __init__(self):
        self._index = -1
        self._open: tuple[str, int] | None = None  # ("text", -1) or ("tool", call index)

    @staticmethod
    def event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, separators=(',', ':'))}\n\n"

    def _start(self, key: tuple[str, int], block: dict) -> list[str]:
        events = self.close()
        self._index += 1
        self._open = key
        return events + [self.event("content_block_start", index=self._index, content_block=block)]

    def delta(self, delta: Delta) -> list[str]:
        events = []
        if delta.reasoning:
            if self._open != ("thinking", -1):
                events += self._start(("thinking", -1), {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self.event("content_block_delta", index=self._index,
                                     delta={"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.text:
            if self._open != ("text", -1):
                events += self._start(("text", -1), {"type": "text", "text": ""})
            events.append(self.event("content_block_delta", index=self._index,
                                     delta={"type": "text_delta", "text": delta.text}))
        for piece in delta.tool_calls:
            if self._open != ("tool", piece.index):
                block = {"type": "tool_use", "id": f"toolu_{piece.id.removeprefix('call_')}", "name": piece.name,
                         "input": {}}
                events += self._start(("tool", piece.index), block)
            if piece.arguments:
                events.append(self.event("content_block_delta", index=self._index,
                                         delta={"type": "input_json_delta", "partial_json": piece.arguments}))
        return events

    def close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [self.event("content_block_stop", index=self._index)]


# -- the routes ---------------------------------------------------------------------------------


def messages_router(client: AsyncClient, model: ModelName, options: ChatOptions) -> APIRouter:
    router = APIRouter()

    async def run_of(request: Request) -> tuple[MessagesRequest, ChatRun, str]:
        body = await parse_body(request, MessagesRequest)
        run, name = await ChatRun.start(client, model, options, chat_request(body), bearer(request), "msg")
        return body, run, name

    @router.post("/v1/messages")
    async def create(request: Request):
        try:
            body, run, name = await run_of(request)
            mid = f"msg_{uuid.uuid4().hex}"
            if not body.stream:
                answer = await until_disconnected(request, run.answer())
                if isinstance(answer, Response):  # the caller went away
                    return answer
                reason = stop_reason(answer.finish, answer.matched_stop)
                return message_object(mid, name, content_blocks(answer), reason, answer.matched_stop,
                                      final_usage(answer.usage))
            deltas = run.deltas()
            first = await anext(deltas, None)
        except PagodaError as exc:
            return _renamed(GatewayError.from_pagoda(exc, chat=True)).anthropic_response()
        except GatewayError as err:
            return _renamed(err).anthropic_response()
        writer = EventWriter()

        async def events() -> AsyncIterator[str]:
            prompt = usage_object(run.stream.num_prompt_tokens or 0, run.stream.num_cached_tokens or 0, 0)
            yield writer.event("message_start", message=message_object(mid, name, [], None, "", prompt))
            yield writer.event("ping")
            try:
                if first is not None:
                    for e in writer.delta(first):
                        yield e
                    async for delta in deltas:
                        for e in writer.delta(delta):
                            yield e
            except PagodaError as exc:
                err = _renamed(GatewayError.from_pagoda(exc, chat=True))
                yield writer.event("error", error=json.loads(err.anthropic_response().body)["error"])
                return
            finally:
                await deltas.aclose()
            for e in writer.close():
                yield e
            yield writer.event("message_delta", delta={"stop_reason": stop_reason(run.finish, run.matched_stop),
                                                       "stop_sequence": run.matched_stop or None},
                               usage=final_usage(run.usage))
            yield writer.event("message_stop")

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """The prompt tokens of the chat completion these messages are (its usage's prompt_tokens)."""
        try:
            body = await parse_body(request, CountTokensRequest)
            chat = chat_request(body)
            tools = [t.function.model_dump(exclude_none=True) for t in chat.tools or ()]
            if chat.tool_choice == "none":
                tools = []
            tokens = await client.tokenize(messages=chat_messages(chat), tools=tools, api_key=bearer(request))
        except PagodaError as exc:
            return _renamed(GatewayError.from_pagoda(exc, chat=True)).anthropic_response()
        except GatewayError as err:
            return _renamed(err).anthropic_response()
        return {"input_tokens": len(tokens.token_ids)}

    return router
