"""The reference for structured output: transformers + `xgrammar.contrib.hf.LogitsProcessor`.

The grammar is compiled here independently of Pagoda's code (`pagoda.grammars`), the way
xgrammar's docs do it for transformers, and the constraint cases every structured-output
test uses are defined once, each with a checker of its finished text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

import torch

from pagoda.constraint import Constraint

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
LABEL_SCHEMA = {  # short and bounded: sampled outputs end well within their max_tokens
    "type": "object",
    "properties": {"label": {"enum": ["cat", "dog"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["label", "score"],
    "additionalProperties": False,
}
DATE_REGEX = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
ANSWER_GRAMMAR = 'root ::= "The answer is " [0-9]+ "."'
CHOICES = ("positive", "negative", "neutral")


def _person(text: str) -> bool:
    value = json.loads(text)
    return set(value) >= {"name", "age"} and isinstance(value["name"], str) and type(value["age"]) is int


def _label(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"label", "score"} and value["label"] in ("cat", "dog") and type(value["score"]) is int and 0 <= value["score"] <= 9


def _object(text: str) -> bool:
    return isinstance(json.loads(text), dict)


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def tool_call_tag() -> str:
    """What the gateway sends for `tools=[get_weather]`, `tool_choice` naming it: the model family's
    tool-call format (Qwen 3's `<tool_call>` JSON) as an xgrammar structural tag."""
    import xgrammar as xgr

    choice = {"type": "function", "function": {"name": "get_weather"}}
    return xgr.get_model_structural_tag("qwen_3", tools=[WEATHER_TOOL], tool_choice=choice, reasoning=False).model_dump_json()


def _tool_call(text: str) -> bool:
    begin, end = "<tool_call>\n", "\n</tool_call>"
    if not (text.startswith(begin) and text.endswith(end)):
        return False
    call = json.loads(text[len(begin) : -len(end)])
    return call["name"] == "get_weather" and isinstance(call["arguments"]["city"], str)


@dataclass(frozen=True)
class Case:
    name: str
    constraint: Constraint
    prompt: str  # a user message (the chat template is applied)
    max_tokens: int
    valid: Callable[[str], bool]  # for a finished (EOS) output's text


CASES = [
    Case("json_schema", Constraint.json_schema(PERSON_SCHEMA), "Describe Ana, who is 31, as JSON with her name and age.", 32, _person),
    Case("regex", Constraint.regex(DATE_REGEX), "When did the Berlin wall fall? Answer with the date.", 16, lambda t: re.fullmatch(DATE_REGEX, t) is not None),
    Case("choice", Constraint.choice(CHOICES), "What is the sentiment of 'I love this film'?", 8, lambda t: t in CHOICES),
    Case("grammar", Constraint.grammar(ANSWER_GRAMMAR), "What is 12 + 30?", 16, lambda t: re.fullmatch(r"The answer is [0-9]+\.", t) is not None),
    Case("structural_tag", Constraint.structural_tag(tool_call_tag()), "What is the weather in Paris?", 32, _tool_call),
    Case("json_object", Constraint.json_object(), "Describe a cat as a JSON object.", 24, _object),  # last: the failover's
]
SAMPLED_CASES = [  # outputs that end quickly, for many seeded draws
    Case("json_schema", Constraint.json_schema(LABEL_SCHEMA), "Is a kitten a cat or a dog? Answer as JSON with a score.", 40, _label),
    Case("regex", Constraint.regex(DATE_REGEX), "Pick any date.", 16, lambda t: re.fullmatch(DATE_REGEX, t) is not None),
    Case("choice", Constraint.choice(CHOICES), "Sentiment of 'meh'?", 8, lambda t: t in CHOICES),
    Case("grammar", Constraint.grammar(ANSWER_GRAMMAR), "Pick a number.", 12, lambda t: re.fullmatch(r"The answer is [0-9]+\.", t) is not None),
]


class Reference:
    """Compiles constraints for transformers' tokenizer as xgrammar's docs do, and generates greedily with them."""

    def __init__(self, model, tokenizer) -> None:
        import xgrammar as xgr

        self.model, self.tokenizer = model, tokenizer
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size)
        self.compiler = xgr.GrammarCompiler(info)

    def compile(self, constraint: Constraint):
        kind, c = constraint.kind.value, self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(constraint.value)
        if kind == "regex":
            return c.compile_regex(constraint.value)
        if kind == "grammar":
            return c.compile_grammar(constraint.value)
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "choice":  # written out here, not through pagoda.constraint.choice_grammar
            return c.compile_grammar("root ::= " + " | ".join(f'"{choice}"' for choice in constraint.choices))
        return c.compile_structural_tag(constraint.value)

    def prompt_ids(self, content: str) -> list[int]:
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def greedy(self, prompt_ids: list[int], constraint: Constraint, max_new_tokens: int) -> list[int]:
        """transformers' greedy tokens under the constraint (EOS included when it ends)."""
        import xgrammar as xgr

        processor = xgr.contrib.hf.LogitsProcessor(self.compile(constraint))
        with torch.inference_mode():
            out = self.model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                logits_processor=[processor],
            )
        return out[0, len(prompt_ids) :].tolist()

    def is_valid_prefix(self, constraint: Constraint, token_ids: list[int]) -> bool:
        """Whether xgrammar's matcher accepts every token (an output cut by max_tokens or a stop)."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compile(constraint))
        return all(matcher.accept_token(t) for t in token_ids)
