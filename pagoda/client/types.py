"""Typed parameters and results of the client, and their one conversion to and from protobuf.

`GenerateParams` holds every knob of `GenerateRequest` (sampling, stopping, response
options, priority, a structured-output constraint, the LoRA adapter) as plain Python values; `None` means
"the server's default". A stream
yields `Chunk`s: the text delta of one output index with its token ids, their logprobs and,
on the last chunk of that index, the finish reason.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields

from pagoda.v1 import generation_pb2 as pb

Prompt = str | Sequence[int]
"""Text (tokenized by the server) or token ids."""


class FinishReason(str, enum.Enum):
    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    STOP_TOKEN = "stop_token"
    LENGTH = "length"
    ABORTED = "aborted"

    @classmethod
    def from_proto(cls, value: int) -> FinishReason | None:
        return _FINISH_FROM_PROTO.get(value)


_FINISH_FROM_PROTO = {
    pb.FINISH_REASON_EOS: FinishReason.EOS,
    pb.FINISH_REASON_STOP_SEQUENCE: FinishReason.STOP_SEQUENCE,
    pb.FINISH_REASON_STOP_TOKEN: FinishReason.STOP_TOKEN,
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_ABORTED: FinishReason.ABORTED,
}

_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "n",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "beam_width",
)


@dataclass(frozen=True)
class GenerateParams:
    """Sampling, stopping and response options of one request (`None`: the server's default)."""

    max_tokens: int | None = None
    temperature: float | None = None  # 0 = greedy; server default 1
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    beam_width: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool | None = None
    priority: int | None = None
    # structured output, at most one (vLLM's names): a JSON schema (dict or JSON text), a
    # regex, an EBNF grammar, any JSON object, one of the choices, an xgrammar structural tag
    json_schema: Mapping | str | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    choice: Sequence[str] | None = None
    structural_tag: Mapping | str | None = None
    # functions the model may call (chat prompts only), as OpenAI writes them:
    # {"type": "function", "function": {"name", "description", "parameters"}} or the inner dict
    tools: Sequence[Mapping] = ()
    # the LoRA adapter to apply, by name (`GenerateRequest.model`); None, or the base model's
    # name: the base weights. One the scheduler has not loaded is NotFound naming `model`.
    model: str | None = None
    # the reasoning split (`GenerateRequest.reasoning_parser`): None = the server's choice,
    # "none" = no split, or a parser's name; chunks carry the reasoning in `reasoning_text`
    reasoning_parser: str | None = None
    # variables for the chat template (chat prompts only), e.g. {"enable_thinking": False}
    chat_template_kwargs: Mapping | None = None

    @classmethod
    def of(cls, params: GenerateParams | None = None, **overrides) -> GenerateParams:
        """`params` with `overrides` applied (unknown names raise TypeError)."""
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown generate parameter(s): {', '.join(sorted(unknown))}")
        base = {f.name: getattr(params, f.name) for f in fields(cls)} if params else {}
        return cls(**{**base, **overrides})

    def fill(self, req: pb.GenerateRequest) -> pb.GenerateRequest:
        """Write these options into `req` (its prompt and request id are left alone)."""
        for name in _SAMPLING_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(req.sampling, name, value)
        for token_id, bias in self.logit_bias.items():
            req.sampling.logit_bias[int(token_id)] = float(bias)
        stopping = req.stopping
        if self.max_tokens is not None:
            stopping.max_tokens = self.max_tokens
        if self.min_tokens is not None:
            stopping.min_tokens = self.min_tokens
        stopping.stop.extend(self.stop)
        stopping.stop_token_ids.extend(self.stop_token_ids)
        stopping.ignore_eos = self.ignore_eos
        stopping.include_stop_str_in_output = self.include_stop_str_in_output
        req.response.logprobs = self.logprobs
        req.response.top_logprobs = self.top_logprobs
        if self.skip_special_tokens is not None:
            req.response.skip_special_tokens = self.skip_special_tokens
        if self.priority is not None:
            req.priority = self.priority
        if self.model:
            req.model = self.model
        if self.reasoning_parser is not None:
            req.reasoning_parser = self.reasoning_parser
        if self.chat_template_kwargs is not None:
            if req.WhichOneof("prompt") != "chat":
                raise ValueError("chat_template_kwargs need a chat prompt (chat(), not generate())")
            req.chat.chat_template_kwargs = json.dumps(dict(self.chat_template_kwargs))
        self._fill_constraint(req.constraint)
        if self.tools:
            if req.WhichOneof("prompt") != "chat":
                raise ValueError("tools need a chat prompt (chat(), not generate())")
            req.chat.tools.extend(_tool(t) for t in self.tools)
        return req

    def _fill_constraint(self, msg: pb.Constraint) -> None:
        given = {
            name: value
            for name, value in (
                ("json_schema", self.json_schema), ("regex", self.regex), ("grammar", self.grammar),
                ("json_object", self.json_object or None), ("choice", self.choice), ("structural_tag", self.structural_tag),
            )
            if value is not None
        }
        if len(given) > 1:
            raise ValueError(f"at most one constraint, got {', '.join(sorted(given))}")
        for name, value in given.items():
            if name == "choice":
                msg.choice.choices.extend(value)
            elif name == "json_object":
                msg.json_object = True
            else:
                setattr(msg, name, value if isinstance(value, str) else json.dumps(value))


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def _json_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _tool(tool: Mapping) -> pb.Tool:
    f = tool.get("function", tool)
    parameters = f.get("parameters")
    return pb.Tool(name=f["name"], description=f.get("description") or "",
                   parameters=_json_text(parameters) if parameters is not None else "")


def chat_tools(tools: Iterable[Mapping]) -> list[pb.Tool]:
    """Functions as OpenAI writes them (`{"type": "function", "function": {...}}` or the inner dict)."""
    return [_tool(t) for t in tools]


def _tool_call(call: Mapping) -> pb.ToolCall:
    f = call.get("function", call)
    return pb.ToolCall(id=call.get("id") or "", name=f["name"], arguments=_json_text(f.get("arguments", {})))


def _content(content) -> tuple[str, list[pb.ContentPart]]:
    """(content, parts) of OpenAI's message content: a text, or a list of "text" and "image_url" parts
    (with an image: the parts in order; text only: joined with newlines, as vLLM joins them)."""
    if not isinstance(content, list):
        return content or "", []
    parts = []
    for item in content:
        if item.get("type") == "text":
            parts.append(pb.ContentPart(text=item.get("text") or ""))
        elif item.get("type") == "image_url":
            image_url = item.get("image_url")
            url = image_url.get("url", "") if isinstance(image_url, Mapping) else image_url
            parts.append(pb.ContentPart(image=pb.Image(url=url)))
        else:
            raise ValueError(f"content part type {item.get('type')!r}: only \"text\" and \"image_url\"")
    if any(part.HasField("image") for part in parts):
        return "", parts
    return "\n".join(part.text for part in parts), []


def chat_messages(messages: Iterable[ChatMessage | Mapping | tuple[str, str]]) -> list[pb.ChatMessage]:
    """Messages given as ChatMessage, {"role", "content"} dicts (OpenAI's, so also an
    assistant's "tool_calls" and a tool's "tool_call_id") or (role, content) pairs."""
    out = []
    for m in messages:
        if isinstance(m, ChatMessage):
            out.append(pb.ChatMessage(role=m.role, content=m.content))
        elif isinstance(m, Mapping):
            content, parts = _content(m.get("content"))
            out.append(pb.ChatMessage(role=m["role"], content=content, parts=parts,
                                      tool_calls=[_tool_call(c) for c in m.get("tool_calls") or ()],
                                      tool_call_id=m.get("tool_call_id") or ""))
        else:
            role, content = m
            out.append(pb.ChatMessage(role=role, content=content))
    return out


def build_request(prompt: Prompt | None, chat, params: GenerateParams, request_id: str) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id)
    if chat is not None:
        req.chat.messages.extend(chat_messages(chat))
    elif isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return params.fill(req)


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()

    @classmethod
    def from_proto(cls, msg: pb.TokenLogprob) -> TokenLogprob:
        return cls(msg.token_id, msg.logprob, tuple(TopLogprob(t.token_id, t.logprob) for t in msg.top))


@dataclass(frozen=True)
class Chunk:
    """A piece of output index `index`: its text delta, token ids, their logprobs (when asked)
    and, on the last chunk of that index, the finish reason (and the stop string that matched)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    matched_stop: str = ""
    reasoning_text: str = ""  # the reasoning's delta, apart from `text` (a reasoning parser's split)

    @classmethod
    def from_proto(cls, out: pb.SequenceOutput) -> Chunk:
        return cls(
            index=out.index,
            text=out.text,
            token_ids=tuple(out.token_ids),
            logprobs=tuple(TokenLogprob.from_proto(lp) for lp in out.logprobs),
            finish_reason=FinishReason.from_proto(out.finish_reason),
            matched_stop=out.matched_stop,
            reasoning_text=out.reasoning_text,
        )


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    reasoning_tokens: int = 0  # of the completion tokens, the reasoning's (Usage.reasoning_tokens)


@dataclass
class Output:
    """One output index joined from its chunks."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str = ""
    reasoning_text: str = ""

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.reasoning_text += chunk.reasoning_text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.matched_stop = chunk.matched_stop


@dataclass
class Completion:
    """A whole stream: outputs by index (0..n-1) and the request's usage."""

    request_id: str
    outputs: list[Output]
    usage: Usage | None

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @classmethod
    def join(cls, request_id: str, chunks: Iterable[Chunk], usage: Usage | None) -> Completion:
        by_index: dict[int, Output] = {}
        for chunk in chunks:
            by_index.setdefault(chunk.index, Output(chunk.index)).add(chunk)
        return cls(request_id, [by_index[i] for i in sorted(by_index)], usage)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    lora_adapters: tuple[str, ...] = ()  # the LoRA adapters loaded now, by name (`model=` selects one)
    reasoning_parser: str = ""  # the server's for chat prompts ("" none)
    tool_call_parser: str = ""  # the tool-call format of its chat template (pagoda.tool_parsers)

    @classmethod
    def from_proto(cls, msg: pb.ModelInfo) -> ModelInfo:
        return cls(msg.name, msg.max_model_len, msg.vocab_size, tuple(msg.eos_token_ids), msg.block_size,
                   tuple(msg.lora_adapters), msg.reasoning_parser, msg.tool_call_parser)


@dataclass(frozen=True)
class ExecutorInfo:
    executor_id: str
    device: str
    healthy: bool
    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_running: int
    num_waiting: int


@dataclass(frozen=True)
class ServerInfo:
    version: str
    num_running: int
    num_waiting: int
    num_preemptions: int
    executors: tuple[ExecutorInfo, ...]

    @classmethod
    def from_proto(cls, msg: pb.ServerInfo) -> ServerInfo:
        executors = tuple(
            ExecutorInfo(
                e.executor_id, e.device, e.healthy, e.num_total_blocks, e.num_free_blocks,
                e.num_cached_blocks, e.num_running, e.num_waiting,
            )
            for e in msg.executors
        )
        return cls(msg.version, msg.num_running, msg.num_waiting, msg.num_preemptions, executors)


@dataclass(frozen=True)
class Tokens:
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]


EmbedInput = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]
"""What Embed takes: a text, texts, one list of token ids, or several."""


def embed_request(inputs: EmbedInput, *, normalize: bool | None = None, dimensions: int | None = None,
                  truncate_prompt_tokens: int | None = None, request_id: str = "", model: str = "") -> pb.EmbedRequest:
    """An EmbedRequest of `inputs`: a text, texts, one list of token ids or several (as OpenAI's `input`)."""
    req = pb.EmbedRequest(request_id=request_id, model=model)
    if isinstance(inputs, str):
        req.texts.append(inputs)
    elif inputs and all(isinstance(item, str) for item in inputs):
        req.texts.extend(inputs)
    elif inputs and all(isinstance(item, int) and not isinstance(item, bool) for item in inputs):
        req.token_ids.append(pb.TokenIds(ids=inputs))
    else:
        for item in inputs:
            if isinstance(item, str) or not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                raise ValueError("embed: inputs are a text, texts, a list of token ids or lists of token ids")
            req.token_ids.append(pb.TokenIds(ids=item))
    for name, value in (("normalize", normalize), ("dimensions", dimensions),
                        ("truncate_prompt_tokens", truncate_prompt_tokens)):
        if value is not None:
            setattr(req, name, value)
    return req


def rerank_request(query: str, documents: Sequence[str], *, top_n: int | None = None, request_id: str = "",
                   model: str = "") -> pb.RerankRequest:
    if isinstance(documents, str):
        raise ValueError("rerank: documents is a list of texts")
    req = pb.RerankRequest(request_id=request_id, query=query, documents=documents, model=model)
    if top_n is not None:
        req.top_n = top_n
    return req


@dataclass(frozen=True)
class Embeddings:
    """Embed's answer: one vector per input, in the inputs' order."""

    vectors: tuple[tuple[float, ...], ...]
    usage: Usage

    @classmethod
    def from_proto(cls, msg: pb.EmbedResponse) -> Embeddings:
        ordered = sorted(msg.embeddings, key=lambda e: e.index)
        return cls(tuple(tuple(e.values) for e in ordered), Usage(prompt_tokens=msg.usage.prompt_tokens))


@dataclass(frozen=True)
class RerankResult:
    index: int  # of the document
    relevance_score: float


@dataclass(frozen=True)
class Reranked:
    """Rerank's answer: the documents' scores, best first."""

    results: tuple[RerankResult, ...]
    usage: Usage

    @classmethod
    def from_proto(cls, msg: pb.RerankResponse) -> Reranked:
        return cls(tuple(RerankResult(r.index, r.relevance_score) for r in msg.results),
                   Usage(prompt_tokens=msg.usage.prompt_tokens))
