"""Tool calls in each model family's format: read from text, streamed as OpenAI's deltas, and the
constraint that makes a model write them (`--tool-call-parser`, vLLM's names)::

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Qwen 2.5 / 3, Hermes)
    llama3_json  {"name": "f", "parameters": {...}}, several joined by "; ", an optional
                 leading <|python_tag|>                                      (Llama 3.1 / 3.2)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]; also the newer
                 [TOOL_CALLS]f[ARGS]{...}                                     (Mistral)
    qwen3_coder  <tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>
    pythonic     [f(a=1, b="x"), g()]                                         (Llama 3.2 / 4)

Interface (no torch, gRPC or xgrammar here; tools are OpenAI's dicts, `{"type": "function",
"function": {"name", "parameters", ...}}`):

    parser = get_tool_parser("hermes")                # KeyError names the choices
    content, calls = parser.parse(text, tools)        # calls: [(name, arguments as JSON text)];
                                                      # content: the text before the first call
                                                      # (None when only whitespace), or all of it
    stream = ToolCallStream(parser, tools, parallel)  # one output's OpenAI deltas:
    delta = stream.feed(text_delta)                   #   {"content": ...} and/or {"tool_calls": [...]}
    delta = stream.finish()                           #   at its end; stream.num_calls
    parser.constraint(tools, function=None, parallel=True)
        # {"structural_tag": JSON text} (or {"grammar": EBNF} for pythonic): exactly calls in the
        # format, of `function` (tool_choice naming it) or one or more of the tools ("required")
    choose_tool_parser_from_template(template)        # a name, or None where the template says nothing

Streaming: text streams as content until a call may begin (text that may begin a marker is
held); from there it is held, and each call is sent once it is complete (a first delta with
its id, name and whole arguments). At the end the held text is read as `parse` reads it, so
the deltas join to the same content and calls as the unstreamed answer.

The xgrammar structural tags are written as JSON, as `xgrammar.get_model_structural_tag` builds
them for "qwen_3" (hermes), "llama" (llama3_json) and "qwen_3_coder"; "required" is the calls
back to back (`tags_with_separator`, at least one; one without `parallel`), nothing else.
The pythonic grammar writes each function's keywords in its schema's order (the required ones
always), each value a Python literal of its property's type or enum, calls joined by ", ".
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from dataclasses import dataclass

Call = tuple[str, str]  # (name, arguments as JSON text)


def _json(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _functions(tools) -> list[dict]:
    return [t.get("function", t) for t in tools or ()]


def _parameters(function: dict):
    p = function.get("parameters")
    return True if p is None else p


def _call(obj, name_key="name", args_keys=("arguments", "parameters")) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get(name_key), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj[name_key], _json(args)


def _content(text: str) -> str | None:
    return text if text.strip() else None


def _held(text: str, marker: str) -> int:
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)


def _st(fmt: dict) -> dict:
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)}


def _schema(function: dict, style: str | None = None) -> dict:
    out = {"type": "json_schema", "json_schema": _parameters(function)}
    return {**out, "style": style} if style else out


@dataclass(frozen=True)
class ToolParser:
    name: str
    markers: tuple[str, ...]  # a call begins at one of these
    at_start: bool = False  # calls only at the start of the text (after whitespace)

    # -- finding where calls begin -------------------------------------------------
    def call_start(self, text: str) -> int | None:
        """Where the first call begins; -1 when none can any more; None: undecided (hold it all)."""
        if self.at_start:
            stripped = text.lstrip()
            if not stripped:
                return None
            if any(stripped.startswith(m) for m in self.markers):
                return len(text) - len(stripped)
            if any(m.startswith(stripped) for m in self.markers):
                return None
            return -1
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else -1

    def held(self, text: str) -> int:
        """Characters at the end of `text` that may begin a marker."""
        return max(_held(text, m) for m in self.markers)

    # -- reading -------------------------------------------------------------------
    def parse(self, text: str, tools=None, final: bool = True) -> tuple[str | None, list[Call]]:
        """(content, calls) of `text`; `final` False: only the calls already closed."""
        raise NotImplementedError

    # -- constraining --------------------------------------------------------------
    def call_tag(self, function: dict) -> dict:
        raise NotImplementedError

    separator = "\n"

    def constraint(self, tools, function: str | None = None, parallel: bool = True) -> dict:
        """GenerateParams' constraint keyword and value: calls of `function`, or of any of `tools`."""
        functions = _functions(tools)
        if function is not None:
            return _st(self.call_tag(next(f for f in functions if f["name"] == function)))
        return _st({"type": "tags_with_separator", "tags": [self.call_tag(f) for f in functions],
                    "separator": self.separator, "at_least_one": True, "stop_after_first": not parallel})


class _Hermes(ToolParser):
    _CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def parse(self, text, tools=None, final=True):
        calls, first = [], None
        for m in self._CALL.finditer(text):
            if not m.group(2) and not final:
                break
            try:
                call = _call(json.loads(m.group(1)))
            except ValueError:
                call = None
            if call is None:
                continue
            first = m.start() if first is None else first
            calls.append(call)
        return (_content(text[:first]), calls) if calls else (text, [])

    def call_tag(self, f):
        return {"type": "tag", "begin": f'<tool_call>\n{{"name": "{f["name"]}", "arguments": ', "content": _schema(f),
                "end": "}\n</tool_call>"}


_DECODER = json.JSONDecoder()


def _json_objects(text: str, seps: str) -> list:
    """JSON values one after another, separated by `seps` characters; stops at the first that
    does not decode whole."""
    out, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in seps):
            i += 1
        if i >= len(text):
            return out
        try:
            value, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return out
        out.append(value)


class _Llama3Json(ToolParser):
    separator = "; "

    def parse(self, text, tools=None, final=True):
        body = text.lstrip()
        body = body[len("<|python_tag|>"):] if body.startswith("<|python_tag|>") else body
        if not body.lstrip().startswith("{"):
            return text, []
        calls = []
        for obj in _json_objects(body, ";"):
            call = _call(obj)
            if call is None:
                break
            calls.append(call)
        return (None, calls) if calls else (text, [])

    def call_tag(self, f):
        return {"type": "tag", "begin": f'{{"name": "{f["name"]}", "parameters": ', "content": _schema(f), "end": "}"}


class _Mistral(ToolParser):
    TOKEN = "[TOOL_CALLS]"
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(\[ARGS\])?")

    def parse(self, text, tools=None, final=True):
        first = text.find(self.TOKEN)
        if first < 0:
            return text, []
        calls = []
        for segment in text[first + len(self.TOKEN):].split(self.TOKEN):
            if segment.lstrip().startswith("["):
                values = _json_objects(segment, "")
                calls += [c for c in (_call(o) for o in (values[0] if values and isinstance(values[0], list) else []))
                          if c is not None]
                continue
            m = self._NAMED.match(segment)
            values = _json_objects(segment[m.end():], "") if m else []
            if m and values and isinstance(values[0], dict):
                calls.append((m.group(1), _json(values[0])))
        return (_content(text[:first]), calls) if calls else (text, [])

    def call_tag(self, f):
        return {"type": "tag", "begin": f'{{"name": "{f["name"]}", "arguments": ', "content": _schema(f), "end": "}"}

    def constraint(self, tools, function=None, parallel=True):
        functions = _functions(tools)
        if function is not None:
            f = next(f for f in functions if f["name"] == function)
            return _st({"type": "tag", "begin": f'{self.TOKEN}[{{"name": "{f["name"]}", "arguments": ',
                        "content": _schema(f), "end": "}]"})
        inner = {"type": "tags_with_separator", "tags": [self.call_tag(f) for f in functions], "separator": ", ",
                 "at_least_one": True, "stop_after_first": not parallel}
        return _st({"type": "tag", "begin": f"{self.TOKEN}[", "content": inner, "end": "]"})


def _typed(value: str, schema) -> object:
    """A qwen3_coder parameter's text as its schema's type (vLLM's conversion)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(enum, list):  # blanks around it are the format's (its grammar allows them)
        match = next((e for e in enum if (e if isinstance(e, str) else json.dumps(e)) == value.strip()), None)
        if match is not None:
            return match
    if kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1):
        return value
    if kind == "integer":
        try:
            return int(value)
        except ValueError:
            return value
    if kind == "number":
        try:
            number = float(value)
            return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
        except ValueError:
            return value
    if kind == "boolean":
        return {"true": True, "false": False}.get(value.strip().lower(), value)
    try:
        return json.loads(value)
    except ValueError:
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value


class _Qwen3Coder(ToolParser):
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(</function>|$)", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)

    def parse(self, text, tools=None, final=True):
        schemas = {f["name"]: (_parameters(f) if isinstance(_parameters(f), dict) else {}) for f in _functions(tools)}
        calls, first = [], None
        for m in self._FUNCTION.finditer(text):
            if not m.group(3) and not final:
                break
            name = m.group(1).strip()
            properties = schemas.get(name, {}).get("properties", {})
            args = {}
            for p in self._PARAM.finditer(m.group(2)):
                value = p.group(2)
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                key = p.group(1).strip()
                args[key] = _typed(value, properties.get(key, {}))
            start = text.rfind("<tool_call>", 0, m.start())
            start = start if start >= 0 and not text[start + len("<tool_call>"):m.start()].strip() else m.start()
            first = start if first is None else first
            calls.append((name, _json(args)))
        return (_content(text[:first]), calls) if calls else (text, [])

    def call_tag(self, f):
        return {"type": "tag", "begin": f"<tool_call>\n<function={f['name']}>\n", "content": _schema(f, "qwen_xml"),
                "end": "\n</function>\n</tool_call>"}


_PY_VALUE = r"""
value ::= string | number | "True" | "False" | "None" | list | dict
string ::= "\"" ([^"\\\n] | "\\" [^\n])* "\"" | "'" ([^'\\\n] | "\\" [^\n])* "'"
integer ::= "-"? [0-9]+
number ::= integer ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
list ::= "[" (value ("," " "? value)*)? "]"
dict ::= "{" (value ":" " "? value ("," " "? value ":" " "? value)*)? "}"
"""


def _py_value(schema) -> str:
    """The EBNF of a Python literal that fits `schema` (its enum, or its type; else any literal)."""
    if not isinstance(schema, dict):
        return "value"
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return "(" + " | ".join(json.dumps(repr(e) if not isinstance(e, str) else json.dumps(e)) for e in schema["enum"]) + ")"
    kind = schema.get("type")
    if "const" in schema:
        return json.dumps(repr(schema["const"]) if not isinstance(schema["const"], str) else json.dumps(schema["const"]))
    return {"string": "string", "integer": "integer", "number": "number", "boolean": '("True" | "False")',
            "null": '"None"', "array": "list", "object": "dict"}.get(kind, "value") if isinstance(kind, str) else "value"


class _Pythonic(ToolParser):
    def parse(self, text, tools=None, final=True):
        body = text.strip()
        for tag in ("<|python_start|>", "<|python_end|>"):
            body = body.replace(tag, "")
        body = body.strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, []
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                    return text, []
                args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                calls.append((node.func.id, json.dumps(args, ensure_ascii=False)))
        except (SyntaxError, ValueError, TypeError):
            return text, []
        return None, calls

    def constraint(self, tools, function=None, parallel=True):
        """EBNF of the calls: each function's keywords in its schema's order, the required ones
        always, each value a Python literal of its property's type (or enum)."""
        functions = [f for f in _functions(tools) if function is None or f["name"] == function]
        rules, names = [], []
        for i, f in enumerate(functions):
            schema = _parameters(f) if isinstance(_parameters(f), dict) else {}
            props = list(schema.get("properties", {}).items())
            required = set(schema.get("required", ()))
            n = len(props)
            rules += [f'a{i}_{n} ::= ""', f'b{i}_{n} ::= ""']  # a: nothing written yet; b: after a keyword
            for j in range(n - 1, -1, -1):
                key, sub = props[j]
                kw = f'{json.dumps(key + "=")} {_py_value(sub)}'
                first, rest = f"{kw} b{i}_{j + 1}", f'", " {kw} b{i}_{j + 1}'
                optional = key not in required
                rules.append(f"a{i}_{j} ::= {first}" + (f" | a{i}_{j + 1}" if optional else ""))
                rules.append(f"b{i}_{j} ::= {rest}" + (f" | b{i}_{j + 1}" if optional else ""))
            rules.append(f'call{i} ::= {json.dumps(f["name"] + "(")} a{i}_0 ")"')
            names.append(f"call{i}")
        more = ' (", " call)*' if parallel and function is None else ""
        return {"grammar": f'root ::= "[" call{more} "]"\ncall ::= {" | ".join(names)}\n' + "\n".join(rules) + _PY_VALUE}


TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": _Hermes("hermes", ("<tool_call>",)),
    "llama3_json": _Llama3Json("llama3_json", ("<|python_tag|>", "{"), at_start=True),
    "mistral": _Mistral("mistral", ("[TOOL_CALLS]",)),
    "qwen3_coder": _Qwen3Coder("qwen3_coder", ("<tool_call>", "<function=")),
    "pythonic": _Pythonic("pythonic", ("<|python_start|>", "["), at_start=True),
}
DEFAULT_TOOL_PARSER = "hermes"  # also how the scheduler writes tools for a template that reads none


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool-call parser {name!r}; one of {', '.join(TOOL_PARSERS)}") from None


def choose_tool_parser_from_template(template: str | None) -> str | None:
    """The parser a chat template's tool-call format calls for, where unambiguous (else None)."""
    if not template:
        return None
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_start|>" in template or "[func_name1(" in template:  # Llama 4's; Llama 3.2's pythonic prompt
        return "pythonic"
    if "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template):
        return "llama3_json"
    return None


def call_id(parser: str) -> str:
    """A new tool-call id: Mistral's templates take 9 letters and digits, the others OpenAI's form."""
    if parser == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


class ToolCallStream:
    """One streamed output's OpenAI deltas (see the module docstring)."""

    def __init__(self, parser: ToolParser, tools=None, parallel: bool = True):
        self.parser, self.tools, self.parallel = parser, tools, parallel
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.start: int | None = None  # where held text begins, once a call may have begun
        self.calls: list[dict] = []  # sent, in OpenAI's shape

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def _delta(self, content: str, calls: list[Call]) -> dict:
        delta = {"content": content} if content else {}
        new = []
        for name, arguments in calls:
            call = {"id": call_id(self.parser.name), "type": "function", "function": {"name": name, "arguments": arguments}}
            new.append({"index": len(self.calls), **call})
            self.calls.append(call)
        if new:
            delta["tool_calls"] = new
        return delta

    def feed(self, text: str) -> dict:
        self.text += text
        content = ""
        if self.start is None:
            start = self.parser.call_start(self.text)
            if start is None:
                return {}
            if start < 0:
                safe = len(self.text) - (0 if self.parser.at_start else self.parser.held(self.text))
                content, self.sent = self.text[self.sent:safe], max(self.sent, safe)
                return self._delta(content, [])
            self.start = start
            content, self.sent = self.text[self.sent:start], start
        _, calls = self.parser.parse(self.text, self.tools, final=False)
        calls = calls[: 1 if not self.parallel else None]
        return self._delta(content, calls[len(self.calls):])

    def finish(self) -> dict:
        parsed, calls = self.parser.parse(self.text, self.tools)
        calls = calls[: 1 if not self.parallel else None]
        if not calls:
            content, self.sent = self.text[self.sent:], len(self.text)
            return self._delta(content, [])
        content = parsed or ""
        rest = content[self.sent:] if content.startswith(self.text[:self.sent]) else ""
        return self._delta(rest, calls[len(self.calls):])
