"""Structured output and tool calls: OpenAI's request fields to one constraint, and generated
text back to OpenAI's `tool_calls`.

Constraints (`pagoda/constraint.py` has the mapping), at most one per request, each remembered
with the OpenAI field it came from (the scheduler names `constraint.<kind>` in its errors;
the gateway answers with that field)::

    response_format json_schema / json_object        -> json_schema / json_object
    structured_outputs json / regex / choice / grammar -> json_schema / regex / choice / grammar
      (or vLLM's older guided_json / guided_regex / guided_choice / guided_grammar)
    tools + tool_choice {"function": {"name": f}}     -> a call of f in the model's format
    tools + tool_choice "required"                    -> one or more calls in the model's format

The model's format is its tool-call parser's (`pagoda/tool_parsers.py`: hermes, llama3_json,
mistral, qwen3_coder, pythonic): the gateway's `--tool-call-parser`, by default the one the
scheduler chose from the chat template (`ModelInfo.tool_call_parser`; hermes if none).
`tool_choice` "none" leaves the tools out; otherwise they are described to the model and the
calls it writes are read by that parser, in every mode ("auto", the default with tools: a
model that writes none answers text), and streamed as OpenAI's tool-call deltas.

The tools, an assistant's calls and a tool's answers travel in `pagoda.v1.Chat`; the scheduler
gives them to the model's chat template, or writes them in the Hermes form for a template that
does not read tools (`scheduler_svc/chat.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway_svc.errors import GatewayError
from gateway_svc.schemas import ChatCompletionRequest, Function, _Sampling
from pagoda.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS, ToolCallStream, ToolParser, call_id

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# tool-call formats marked by special tokens, which the text must keep (vLLM turns
# skip_special_tokens off for them too)
SPECIAL_TOKEN_PARSERS = ("mistral",)


@dataclass(frozen=True)
class Structured:
    """A request's constraint (GenerateParams' keyword and value) and the OpenAI field it came
    from, and how its output is read: `mode` None (text), "named", "required" or "auto"."""

    params: dict = field(default_factory=dict)
    param: str | None = None
    mode: str | None = None
    function: str | None = None  # mode "named": its name
    tools: tuple[dict, ...] = ()  # described to the model (all modes but none)
    parser: ToolParser = TOOL_PARSERS[DEFAULT_TOOL_PARSER]  # reads the calls and builds their constraint


def _constraints(req: _Sampling) -> list[tuple[str, dict]]:
    out = []
    rf = req.response_format
    if rf and rf.type == "json_schema":
        out.append(("response_format", {"json_schema": rf.json_schema.schema_ or {}}))
    elif rf and rf.type == "json_object":
        out.append(("response_format", {"json_object": True}))
    so = req.structured_outputs
    if so:
        given = {"json": ("json_schema", so.json_), "regex": ("regex", so.regex), "choice": ("choice", so.choice),
                 "grammar": ("grammar", so.grammar)}
        out += [(f"structured_outputs.{k}", {kind: v}) for k, (kind, v) in given.items() if v is not None]
    old = {"guided_json": ("json_schema", req.guided_json), "guided_regex": ("regex", req.guided_regex),
           "guided_choice": ("choice", req.guided_choice), "guided_grammar": ("grammar", req.guided_grammar)}
    return out + [(k, {kind: v}) for k, (kind, v) in old.items() if v is not None]


def structured(req: _Sampling, parser: ToolParser | None = None) -> Structured:
    """The constraint of `req`, tool calls in `parser`'s format (default hermes); more than one
    constraint is a 400 naming the second."""
    chat = isinstance(req, ChatCompletionRequest)
    parser = parser or TOOL_PARSERS[DEFAULT_TOOL_PARSER]
    given = _constraints(req) + (_tool_constraint(req, parser) if chat else [])
    if len(given) > 1:
        (first, _), (second, _) = given[:2]
        raise GatewayError(400, f"{second}: cannot be combined with {first} (one constraint per request)", param=second)
    param, params = given[0] if given else (None, {})
    if not (chat and req.tools and req.tool_choice != "none"):
        return Structured(params, param)
    tools = tuple(t.model_dump(exclude_none=True) for t in req.tools)
    choice = req.tool_choice or "auto"
    if isinstance(choice, str):  # "auto" (any constraint is response_format's) or "required"
        return Structured(params, param, choice, tools=tools, parser=parser)
    return Structured(params, param, "named", choice.function.name, tools, parser)


def _tool_constraint(req: ChatCompletionRequest, parser: ToolParser) -> list[tuple[str, dict]]:
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise GatewayError(400, "tool_choice: needs tools", param="tool_choice")
        return []
    names = [t.function.name for t in req.tools]
    if len(set(names)) < len(names):
        raise GatewayError(400, "tools: function names must be unique", param="tools")
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if req.tool_choice == "required":
        param = "tools[0].function.parameters" if len(names) == 1 else "tools"
        return [(param, parser.constraint(tools, parallel=req.parallel_tool_calls))]
    if req.tool_choice in (None, "none", "auto"):
        return []
    name = req.tool_choice.function.name
    if name not in names:
        raise GatewayError(400, f"tool_choice: no function {name!r} in tools", param="tool_choice")
    i = names.index(name)
    return [(f"tools[{i}].function.parameters", parser.constraint(tools, function=name))]


def _parameters(function: Function) -> dict:
    return function.parameters if function.parameters is not None else _EMPTY_PARAMETERS


def required_schema(tools, parallel: bool = True) -> dict:
    """A JSON array of one or more calls (one without `parallel`), each `{"name": <a tool's>,
    "parameters": <arguments fitting its schema>}` (vLLM's schema for tool_choice "required",
    kept for clients that build it themselves; the gateway constrains the model's own format)."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                               "parameters": _parameters(t.function)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return schema if parallel else {**schema, "maxItems": 1}


# -- reading the output ---------------------------------------------------------------


def tool_call(name: str, arguments: str, parser: str = DEFAULT_TOOL_PARSER) -> dict:
    return {"id": call_id(parser), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_hermes(text: str) -> tuple[str, list[tuple[str, str]]]:
    """Text with Hermes / Qwen tool calls as (the text before the calls, or all of it when there
    are none; [(name, arguments as JSON text)])."""
    content, calls = TOOL_PARSERS["hermes"].parse(text)
    return content or "", calls


def read_output(s: Structured, text: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """A choice's finished text as (content, tool_calls) in OpenAI's shape."""
    if s.mode is None:
        return text, []
    content, calls = s.parser.parse(text, s.tools)
    calls = calls[:1] if not parallel else calls
    return (content if calls else text), [tool_call(n, a, s.parser.name) for n, a in calls]


class ToolDeltas:
    """One streamed choice's deltas (`pagoda.tool_parsers.ToolCallStream`): text streams until a
    call may begin, each call is sent when it is complete, the rest is read at the end."""

    def __init__(self, s: Structured, parallel: bool):
        self.s = s
        self.stream = ToolCallStream(s.parser, s.tools, parallel)

    @property
    def num_calls(self) -> int:
        return self.stream.num_calls

    def add(self, text: str, finished: bool) -> dict:
        """The delta's fields (`content`, `tool_calls`) for `text`."""
        delta = self.stream.feed(text) if text else {}
        if finished:
            last = self.stream.finish()
            if "content" in last:
                delta["content"] = delta.get("content", "") + last["content"]
            if "tool_calls" in last:
                delta["tool_calls"] = delta.get("tool_calls", []) + last["tool_calls"]
        return delta
