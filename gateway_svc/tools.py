"""Structured output and tool calls: OpenAI's request fields to one constraint, and generated
text back to OpenAI's `tool_calls`.

Constraints (`pagoda/constraint.py` has the mapping), at most one per request, each remembered
with the OpenAI field it came from (the scheduler names `constraint.<kind>` in its errors;
the gateway answers with that field)::

    response_format json_schema / json_object        -> json_schema / json_object
    structured_outputs json / regex / choice / grammar -> json_schema / regex / choice / grammar
      (or vLLM's older guided_json / guided_regex / guided_choice / guided_grammar)
    tools + tool_choice {"function": {"name": f}}     -> json_schema(f's parameters)
    tools + tool_choice "required"                    -> json_schema(an array of calls, below)

`tool_choice` "none" leaves the tools out; otherwise they are described to the model and the
calls it writes in the Hermes / Qwen form, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
are parsed ("auto", the default with tools; a model that writes none answers text).

The tools, an assistant's calls and a tool's answers travel in `pagoda.v1.Chat`; the scheduler
gives them to the model's chat template, or writes them in the Hermes form for a template that
does not read tools (`scheduler_svc/chat.py`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from gateway_svc.errors import GatewayError
from gateway_svc.schemas import ChatCompletionRequest, Function, _Sampling

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Structured:
    """A request's constraint (GenerateParams' keyword and value) and the OpenAI field it came
    from, and how its output is read: `mode` None (text), "named", "required" or "auto"."""

    params: dict = field(default_factory=dict)
    param: str | None = None
    mode: str | None = None
    function: str | None = None  # mode "named": its name
    tools: tuple[dict, ...] = ()  # described to the model (all modes but none)


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


def structured(req: _Sampling) -> Structured:
    """The constraint of `req`; more than one is a 400 naming the second."""
    chat = isinstance(req, ChatCompletionRequest)
    given = _constraints(req) + (_tool_constraint(req) if chat else [])
    if len(given) > 1:
        (first, _), (second, _) = given[:2]
        raise GatewayError(400, f"{second}: cannot be combined with {first} (one constraint per request)", param=second)
    param, params = given[0] if given else (None, {})
    if not (chat and req.tools and req.tool_choice != "none"):
        return Structured(params, param)
    tools = tuple(t.model_dump(exclude_none=True) for t in req.tools)
    choice = req.tool_choice or "auto"
    if isinstance(choice, str):  # "auto" (any constraint is response_format's) or "required"
        return Structured(params, param, choice, tools=tools)
    return Structured(params, param, "named", choice.function.name, tools)


def _tool_constraint(req: ChatCompletionRequest) -> list[tuple[str, dict]]:
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise GatewayError(400, "tool_choice: needs tools", param="tool_choice")
        return []
    names = [t.function.name for t in req.tools]
    if len(set(names)) < len(names):
        raise GatewayError(400, "tools: function names must be unique", param="tools")
    if req.tool_choice == "required":
        param = "tools[0].function.parameters" if len(names) == 1 else "tools"
        return [(param, {"json_schema": required_schema(req.tools, req.parallel_tool_calls)})]
    if req.tool_choice in (None, "none", "auto"):
        return []
    name = req.tool_choice.function.name
    if name not in names:
        raise GatewayError(400, f"tool_choice: no function {name!r} in tools", param="tool_choice")
    i = names.index(name)
    return [(f"tools[{i}].function.parameters", {"json_schema": _parameters(req.tools[i].function)})]


def _parameters(function: Function) -> dict:
    return function.parameters if function.parameters is not None else _EMPTY_PARAMETERS


def required_schema(tools, parallel: bool = True) -> dict:
    """A JSON array of one or more calls (one without `parallel`), each `{"name": <a tool's>,
    "parameters": <arguments fitting its schema>}` (vLLM's schema for tool_choice "required")."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                               "parameters": _parameters(t.function)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return schema if parallel else {**schema, "maxItems": 1}


# -- reading the output ---------------------------------------------------------------


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _json(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
TAG = "<tool_call>"


def parse_hermes(text: str) -> tuple[str, list[tuple[str, str]]]:
    """Text with Hermes / Qwen tool calls, `<tool_call>{"name": n, "arguments": {...}}</tool_call>`
    (the last one may be unclosed when the model stops at EOS), as (the text outside the calls,
    [(name, arguments as JSON text)]). A call that is not such JSON stays in the text."""
    calls, kept, pos = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
            name, arguments = call["name"], call.get("arguments", call.get("parameters", {}))
        except (ValueError, KeyError, TypeError):
            continue
        if not isinstance(name, str):
            continue
        kept.append(text[pos:match.start()])
        pos = match.end()
        calls.append((name, _json(arguments)))
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


def read_output(s: Structured, text: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """A choice's finished text as (content, tool_calls) in OpenAI's shape."""
    if s.mode == "named":
        return None, [tool_call(s.function, text)]
    if s.mode == "required":
        try:
            calls = [(c["name"], _json(c["parameters"])) for c in json.loads(text)]
        except (ValueError, KeyError, TypeError):  # cut short by max_tokens
            return text, []
        return None, [tool_call(n, a) for n, a in calls]
    if s.mode == "auto":
        content, calls = parse_hermes(text)
        calls = calls[:1] if not parallel else calls
        return (content or None) if calls else text, [tool_call(n, a) for n, a in calls]
    return text, []


def _tag_start(text: str) -> int:
    """The length of the longest end of `text` that `<tool_call>` begins with."""
    return next((k for k in range(min(len(TAG) - 1, len(text)), 0, -1) if TAG.startswith(text[-k:])), 0)


class ToolDeltas:
    """One streamed choice's deltas: with a named function the arguments stream as generated
    (its name and id in the first delta); otherwise text streams until a tool call may begin,
    and the rest is held and read when the choice finishes."""

    def __init__(self, s: Structured, parallel: bool):
        self.s, self.parallel = s, parallel
        self.held = ""
        self.num_calls = 0

    def add(self, text: str, finished: bool) -> dict:
        """The delta's fields (`content`, `tool_calls`) for `text`."""
        if self.s.mode == "named":
            if self.num_calls:
                return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
            self.num_calls = 1
            return {"tool_calls": [{"index": 0, **tool_call(self.s.function, text)}]}
        self.held += text
        if self.s.mode == "auto" and TAG not in self.held and not finished:
            keep = _tag_start(self.held)
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
            return {"content": out} if out else {}
        if not finished:
            return {}
        content, calls = read_output(self.s, self.held, self.parallel)
        self.num_calls = len(calls)
        delta = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        return delta
