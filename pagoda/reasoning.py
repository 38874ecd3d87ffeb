"""Reasoning split: the thinking a reasoning model writes (`<think>…</think>`) apart from its answer.

The parsers are vLLM's, by its names (`--reasoning-parser`)::

    qwen3        <think> … </think>; reasoning only where a block is open: the prompt opened it
                 (a template that ends with `<think>`) or the output starts with `<think>`
    deepseek_r1  <think> … </think>; the output is reasoning until `</think>` even when no block
                 was opened (R1's templates open it in the prompt), a leading `<think>` dropped
    mistral      [THINK] … [/THINK] (Magistral), as qwen3
    none         no split

A prompt whose last tag closes the block (Qwen3's `enable_thinking: false` writes
`<think>\\n\\n</think>\\n\\n`) starts in the answer. After the end tag everything is answer.

Interface (no torch, gRPC or tokenizer here; the scheduler runs one splitter per output):

    parser = get_reasoning_parser("qwen3")            # None for "none"; KeyError names the choices
    splitter = parser.splitter(prompt_text)           # the prompt's tail decides the start state
    reasoning, content = splitter.feed(text_delta)    # text that may start a tag is held back
    reasoning, content = splitter.flush()             # at the end of the output
    parser.split(prompt_text, whole_text)             # the same for a whole text at once
    choose_reasoning_parser_from_template(template)   # "qwen3", "deepseek_r1", "mistral" or None

`splitter.reasoning_ends` tells whether the output may still be in a reasoning block, for the
constraint that must start once it ends (`reasoning_prefix_format`).
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING = "reasoning"
CONTENT = "content"
MAYBE = "maybe"  # before the first output text: a start tag would open a block


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str
    end: str
    # text before the end tag is reasoning even without a start tag (DeepSeek-R1)
    implicit_start: bool = False

    def initial_state(self, prompt_text: str) -> str:
        """REASONING, CONTENT or MAYBE for an output that follows `prompt_text` (its tail suffices)."""
        opened, closed = prompt_text.rfind(self.start), prompt_text.rfind(self.end)
        if opened > closed:
            return REASONING
        if closed >= 0:
            return CONTENT
        return REASONING if self.implicit_start else MAYBE

    def splitter(self, prompt_text: str = "") -> ReasoningSplitter:
        return ReasoningSplitter(self, self.initial_state(prompt_text))

    def split(self, prompt_text: str, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        s = self.splitter(prompt_text)
        r1, c1 = s.feed(text)
        r2, c2 = s.flush()
        return r1 + r2, c1 + c2


def _held(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class ReasoningSplitter:
    """One output's split, fed its text deltas in order: each feed returns (reasoning, content)."""

    def __init__(self, parser: ReasoningParser, state: str):
        self.parser = parser
        self.state = state
        self._pending = ""
        self._at_start = True  # nothing fed yet: a leading start tag is dropped

    @property
    def reasoning_ends(self) -> bool:
        """True once the output is past any reasoning (what follows is the answer)."""
        return self.state == CONTENT

    def feed(self, text: str) -> tuple[str, str]:
        if self.state == CONTENT and not self._pending:
            return "", text
        self._pending += text
        reasoning = content = ""
        start, end = self.parser.start, self.parser.end
        if self._at_start:
            head = self._pending
            if head.startswith(start):
                self._pending, self._at_start = head[len(start):], False
                self.state = REASONING
            elif start.startswith(head):
                return "", ""  # may still become the start tag
            else:
                self._at_start = False
                if self.state == MAYBE:
                    self.state = CONTENT
        if self.state == REASONING:
            i = self._pending.find(end)
            if i < 0:
                keep = _held(self._pending, end)
                cut = len(self._pending) - keep
                reasoning, self._pending = self._pending[:cut], self._pending[cut:]
                return reasoning, ""
            reasoning, self._pending = self._pending[:i], self._pending[i + len(end):]
            self.state = CONTENT
        content, self._pending = self._pending, ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is held back, at the end of the output: a partial tag is text of its block."""
        held, self._pending = self._pending, ""
        if self.state == REASONING:
            return held, ""
        if self.state == MAYBE:
            self.state = CONTENT
        return "", held


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3", "<think>", "</think>"),
    "deepseek_r1": ReasoningParser("deepseek_r1", "<think>", "</think>", implicit_start=True),
    "mistral": ReasoningParser("mistral", "[THINK]", "[/THINK]"),
}
NONE = "none"
AUTO = "auto"


def reasoning_parser_names() -> list[str]:
    return [*REASONING_PARSERS, NONE]


def get_reasoning_parser(name: str) -> ReasoningParser | None:
    """The parser named `name` (None for "none" or ""); KeyError naming the choices otherwise."""
    if name in ("", NONE):
        return None
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown reasoning parser {name!r}; one of {', '.join(reasoning_parser_names())}") from None


def choose_reasoning_parser_from_template(template: str | None) -> str | None:
    """The parser a chat template's reasoning tags call for, where unambiguous (else None)."""
    if not template:
        return None
    if "[THINK]" in template and "[/THINK]" in template:
        return "mistral"
    if "</think>" not in template:
        return None
    if "<｜Assistant｜>" in template:  # DeepSeek-R1 and its distills (Qwen2, Llama)
        return "deepseek_r1"
    return "qwen3"


def reasoning_prefix_format(parser: ReasoningParser, state: str) -> dict | None:
    """The part of an xgrammar structural tag (its JSON form) that lets a reasoning block be
    written unconstrained before a constraint applies; None when the output starts in the answer.

    REASONING: free text up to the end tag; MAYBE: an optional block, start tag to end tag.
    """
    if state == CONTENT:
        return None
    if state == REASONING:
        return {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": parser.end}
    return {"type": "optional", "content": {"type": "tag", "begin": parser.start, "content": {"type": "any_text"},
                                             "end": parser.end}}


def constrain_after_reasoning(constraint, parser: ReasoningParser, state: str):
    """`constraint` (a `pagoda.constraint.Constraint`) applied after the reasoning block, as vLLM
    starts the grammar once reasoning ends: a structural tag of the free reasoning block
    (`reasoning_prefix_format`) then the constraint; unchanged when the output starts in the answer.

    A structural tag in xgrammar's older form (`structures` and `triggers`) cannot be nested and
    stays as it is: such a tag should allow the reasoning itself.
    """
    import json

    from pagoda.constraint import Constraint, ConstraintKind, choice_grammar

    prefix = reasoning_prefix_format(parser, state)
    if prefix is None:
        return constraint
    kind = constraint.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        inner = {"type": "json_schema", "json_schema": json.loads(constraint.value)}
    elif kind is ConstraintKind.JSON_OBJECT:
        inner = {"type": "json_schema", "json_schema": {"type": "object"}}
    elif kind is ConstraintKind.REGEX:
        inner = {"type": "regex", "pattern": constraint.value}
    elif kind is ConstraintKind.GRAMMAR:
        inner = {"type": "grammar", "grammar": constraint.value}
    elif kind is ConstraintKind.CHOICE:
        inner = {"type": "grammar", "grammar": choice_grammar(constraint.choices)}
    else:
        tag = json.loads(constraint.value)
        if not isinstance(tag, dict) or "format" not in tag:
            return constraint
        inner = tag["format"]
    return Constraint.structural_tag({"type": "structural_tag", "format": {"type": "sequence", "elements": [prefix, inner]}})
