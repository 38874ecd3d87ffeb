"""A structured-output constraint: the one typed form of `GenerateRequest.constraint`.

The kinds and their names are vLLM's (`SamplingParams.structured_outputs`), the semantics
xgrammar's with its default options (what `xgrammar.contrib.hf.LogitsProcessor` applies
when given the same compiled grammar)::

    kind            value                        xgrammar
    json_schema     a JSON Schema, as JSON text  GrammarCompiler.compile_json_schema(value)
    regex           a regular expression         GrammarCompiler.compile_regex(value)
    grammar         EBNF (GBNF too), rule root   GrammarCompiler.compile_grammar(value)
    json_object     ""                           GrammarCompiler.compile_builtin_json_grammar()
    choice          `choices`                    compile_grammar(choice_grammar(choices))
    structural_tag  an xgrammar structural tag   GrammarCompiler.compile_structural_tag(value)

A request's matcher starts at the first output token and accepts every output token in
order; when the grammar is complete only the model's EOS tokens are allowed, so such a
request finishes with EOS. Its state is a function of (constraint, output tokens): a
preempted, resumed or migrated request rebuilds it from its tokens.

Mapping OpenAI's request shapes onto a constraint (for the HTTP gateway):

* `response_format {"type": "json_schema", "json_schema": {"schema": S}}` -> json_schema(S);
  `{"type": "json_object"}` -> json_object(); vLLM's `structured_outputs` `json` / `regex` /
  `choice` / `grammar` -> the kind of the same name.
* `tools` with `tool_choice` naming one function, or `"required"` -> the model family's calls in
  its own format (`pagoda.tool_parsers`: a structural tag as `xgrammar.get_model_structural_tag`
  writes them, e.g. hermes `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`, or a
  grammar for pythonic calls), what `gateway_svc/tools.py` sends.

With a reasoning parser (`pagoda.reasoning`) the scheduler puts a free reasoning block before the
constraint (`constrain_after_reasoning`), so that it applies to the answer only.

No torch, gRPC or xgrammar here: the scheduler's pure-Python core carries it inside
`SamplingParams`; the scheduler's compile check and the executor's matcher read it.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass


class ConstraintKind(str, enum.Enum):
    """The oneof field names of `pagoda.v1.Constraint`."""

    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    GRAMMAR = "grammar"
    JSON_OBJECT = "json_object"
    CHOICE = "choice"
    STRUCTURAL_TAG = "structural_tag"


@dataclass(frozen=True)
class Constraint:
    """One constraint: `value` is the text of every kind but choice (which has `choices`)
    and json_object (which has neither)."""

    kind: ConstraintKind
    value: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ConstraintKind(self.kind))
        if self.kind is ConstraintKind.CHOICE:
            if self.value:
                raise ValueError("a choice constraint has choices, not a value")
        elif self.choices:
            raise ValueError(f"a {self.kind.value} constraint has no choices")

    @property
    def field(self) -> str:
        """The request field it came from, for error messages: `constraint.<kind>`."""
        return f"constraint.{self.kind.value}"

    @property
    def key(self) -> str:
        """A digest of the content: equal constraints compile to the same grammar (cache key)."""
        body = json.dumps([self.kind.value, self.value, list(self.choices)], ensure_ascii=False)
        return hashlib.sha256(body.encode()).hexdigest()

    @property
    def size(self) -> int:
        """Characters of content (the bound validation puts on a client's grammar)."""
        return len(self.value) + sum(len(c) for c in self.choices)

    # vLLM's names, as constructors
    @classmethod
    def json_schema(cls, schema: str | dict) -> Constraint:
        return cls(ConstraintKind.JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls(ConstraintKind.REGEX, pattern)

    @classmethod
    def grammar(cls, ebnf: str) -> Constraint:
        return cls(ConstraintKind.GRAMMAR, ebnf)

    @classmethod
    def json_object(cls) -> Constraint:
        return cls(ConstraintKind.JSON_OBJECT)

    @classmethod
    def choice(cls, choices) -> Constraint:
        return cls(ConstraintKind.CHOICE, choices=tuple(choices))

    @classmethod
    def structural_tag(cls, tag: str | dict) -> Constraint:
        return cls(ConstraintKind.STRUCTURAL_TAG, tag if isinstance(tag, str) else json.dumps(tag))


def choice_grammar(choices: tuple[str, ...] | list[str]) -> str:
    """The EBNF that accepts exactly one of `choices` (vLLM's `choice_as_grammar`).

    Each choice is a JSON string literal, whose escapes (quote, backslash, control
    characters) xgrammar's EBNF reads the same way.
    """
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
