"""The chat completion behind `/v1/responses` and `/v1/messages`.

Each of those APIs turns its request into a `ChatCompletionRequest` and runs it here, through the
very pieces `/v1/chat/completions` uses (`structured`, `chat_params`, `chat_messages`, the
scheduler's chat template, `read_output` for a whole answer, `ToolDeltas` for a streamed one), so
both answer what chat completions answer for the same messages, token for token. What differs is
only the shape each API gives the answer (`responses.py`, `messages.py`).

The tool-call format and the reasoning split are chat completions' too (`ChatOptions`: the
gateway's `--tool-call-parser` and `--reasoning-parser`, else the scheduler's choice from the chat
template): the reasoning comes apart from the answer (`Chunk.reasoning_text`).

A streamed run yields `Delta`s (reasoning, text, or tool calls as chat completions streams them);
once the stream is done `finish` holds chat completions' finish reason ("stop", "length", "tool_calls"),
`matched_stop` the stop string that ended it, and `usage` the token counts.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway_svc.models import ModelName
from gateway_svc.schemas import ChatCompletionRequest
from gateway_svc.tools import SPECIAL_TOKEN_PARSERS, ToolDeltas, read_output, structured
from gateway_svc.translate import FINISH, chat_messages, chat_params
from pagoda.client import AsyncClient, AsyncStream, Chunk, FinishReason, Usage
from pagoda.tool_parsers import DEFAULT_TOOL_PARSER, get_tool_parser


@dataclass(frozen=True)
class ChatOptions:
    """The gateway's `--reasoning-parser` and `--tool-call-parser` (None: the scheduler's)."""

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of tool call `index`: its id and name come once, with its first piece."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class Delta:
    text: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    reasoning: str = ""


@dataclass
class Answer:
    """A whole answer, as chat completions' `choices[0]` holds it."""

    content: str | None
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's {"id", "type", "function": {name, arguments}}
    finish: str = "stop"
    matched_stop: str = ""
    usage: Usage | None = None


class ChatRun:
    """One chat completion (n = 1) of `body` for the caller with `api_key`."""

    def __init__(self, client: AsyncClient, body: ChatCompletionRequest, adapter: str | None,
                 api_key: str | None, request_id: str, options: ChatOptions, parser_name: str):
        self.body = body
        parser = get_tool_parser(parser_name)
        self.output = structured(body, parser)
        params = chat_params(body, self.output.params, adapter, options.reasoning_parser,
                             special_tokens=bool(self.output.mode) and parser.name in SPECIAL_TOKEN_PARSERS)
        self.stream: AsyncStream = client.chat(chat_messages(body), params, tools=self.output.tools,
                                               request_id=request_id, api_key=api_key)
        self.finish: str | None = None
        self.matched_stop = ""

    @classmethod
    async def start(cls, client: AsyncClient, model: ModelName, options: ChatOptions, body: ChatCompletionRequest,
                    api_key: str | None, prefix: str) -> tuple[ChatRun, str]:
        """The run and the model name a response gives (`model` selects the base or an adapter)."""
        name, adapter = await model.select(body.model, api_key)
        parser = options.tool_call_parser or (model.info and model.info.tool_call_parser) or DEFAULT_TOOL_PARSER
        return cls(client, body, adapter, api_key, f"{prefix}-{uuid.uuid4().hex}", options, parser), name

    @property
    def usage(self) -> Usage | None:
        return self.stream.usage

    def _end(self, chunk: Chunk) -> None:
        if chunk.finish_reason is not None:
            self.finish = FINISH[chunk.finish_reason]
            if chunk.finish_reason == FinishReason.STOP_SEQUENCE:
                self.matched_stop = chunk.matched_stop

    async def answer(self) -> Answer:
        text = reasoning = ""
        async for chunk in self.stream:
            text += chunk.text
            reasoning += chunk.reasoning_text
            self._end(chunk)
        content, calls = read_output(self.output, text, self.body.parallel_tool_calls)
        finish = "tool_calls" if calls and self.finish == "stop" else self.finish
        return Answer(content, reasoning, calls, finish or "stop", self.matched_stop, self.stream.usage)

    async def deltas(self) -> AsyncIterator[Delta]:
        tools = ToolDeltas(self.output, self.body.parallel_tool_calls) if self.output.mode else None
        async for chunk in self.stream:
            self._end(chunk)
            if tools is None:
                if chunk.text or chunk.reasoning_text:
                    yield Delta(chunk.text, reasoning=chunk.reasoning_text)
                continue
            delta = tools.add(chunk.text, chunk.finish_reason is not None)
            calls = tuple(ToolCallDelta(c["index"], c["function"].get("arguments", ""), c.get("id"),
                                        c["function"].get("name")) for c in delta.get("tool_calls", ()))
            if delta.get("content") or calls or chunk.reasoning_text:
                yield Delta(delta.get("content") or "", calls, chunk.reasoning_text)
        if tools is not None and tools.num_calls and self.finish == "stop":
            self.finish = "tool_calls"
        self.finish = self.finish or "stop"
