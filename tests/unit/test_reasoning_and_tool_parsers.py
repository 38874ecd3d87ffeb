"""The reasoning split (`pagoda.reasoning`) and each family's tool-call parser
(`pagoda.tool_parsers`): whole texts, the same texts streamed in every awkward chunking (tags cut
anywhere) giving the same answer, the constraints compiled by xgrammar accepting exactly the
format the parser reads, and the constraint that starts after the reasoning."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st
from xgrammar.testing import _is_grammar_accept_string as accepts

from pagoda import model_files
from pagoda.client.types import GenerateParams, chat_messages
from pagoda.constraint import Constraint
from pagoda.reasoning import (
    CONTENT, MAYBE, REASONING, choose_reasoning_parser_from_template, constrain_after_reasoning, get_reasoning_parser,
)
from pagoda.tool_parsers import TOOL_PARSERS, ToolCallStream, choose_tool_parser_from_template, get_tool_parser
from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.tokenizer import load_tokenizer
from scheduler_svc.validation import chat_token_ids

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
CALLS = [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", '{"zone": "CET"}')]


def chunkings(text: str):
    """The text cut in two at every point, in three at many, and in pieces of 1, 2, 3 and 5."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for i in range(1, len(text), 7):
        for j in range(i + 1, len(text), 11):
            yield [text[:i], text[i:j], text[j:]]
    for k in (1, 2, 3, 5):
        yield [text[i:i + k] for i in range(0, len(text), k)]


# -- reasoning -------------------------------------------------------------------------

REASONING_CASES = [
    # parser, prompt tail, output, (reasoning, content)
    ("qwen3", "<|im_start|>assistant\n", "<think>\nhmm, 2+2\n</think>\n\nIt is 4.", ("\nhmm, 2+2\n", "\n\nIt is 4.")),
    ("qwen3", "<|im_start|>assistant\n", "It is 4, no <think> here", ("", "It is 4, no <think> here")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "hmm</think>It is 4.", ("hmm", "It is 4.")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "still thinking when cut <", ("still thinking when cut <", "")),
    ("qwen3", "assistant\n<think>\n\n</think>\n\n", "<think>x</think>y", ("", "<think>x</think>y")),  # thinking off
    ("qwen3", "", "<thin", ("", "<thin")),
    ("deepseek_r1", "<｜Assistant｜>", "2+2 is 4</think>Four.", ("2+2 is 4", "Four.")),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "<think>a</think>b</think>c", ("a", "b</think>c")),
    ("deepseek_r1", "<｜Assistant｜>", "no end tag at all", ("no end tag at all", "")),
    ("mistral", "[/INST]", "[THINK]plan[/THINK]answer", ("plan", "answer")),
]


@pytest.mark.parametrize("name, prompt, text, want", REASONING_CASES)
def test_the_split_of_whole_and_streamed_texts(name, prompt, text, want):
    parser = get_reasoning_parser(name)
    assert parser.split(prompt, text) == want
    for pieces in chunkings(text):
        splitter = parser.splitter(prompt)
        got = [splitter.feed(p) for p in pieces] + [splitter.flush()]
        assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == want, pieces
        opened = parser.initial_state(prompt) == REASONING or text.startswith(parser.start)
        assert splitter.reasoning_ends is (parser.end in text or not opened)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", "\n", " ", "</th"]), max_size=12),
       st.sampled_from(["", "<think>\n", "<think></think>"]), st.sampled_from(["qwen3", "deepseek_r1"]),
       st.data())
def test_any_text_splits_the_same_however_it_is_cut(pieces, prompt, name, data):
    parser = get_reasoning_parser(name)
    text = "".join(pieces)
    want = parser.split(prompt, text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    bounds = [0, *cuts, len(text)]
    splitter = parser.splitter(prompt)
    got = [splitter.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [splitter.flush()]
    assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == want
    reasoning, content = want
    assert len(reasoning) + len(content) <= len(text)  # the tags are removed, nothing added
    if parser.initial_state(prompt) == CONTENT:
        assert want == ("", text)


def test_parsers_by_name_and_from_templates():
    assert get_reasoning_parser("none") is None and get_reasoning_parser("") is None
    with pytest.raises(KeyError, match="qwen3"):
        get_reasoning_parser("granite9")
    qwen3 = "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    r1 = "{{'<｜Assistant｜>'}}{% if '</think>' in content %}{% endif %}<think>\\n"
    assert choose_reasoning_parser_from_template(qwen3) == "qwen3"
    assert choose_reasoning_parser_from_template(r1) == "deepseek_r1"
    assert choose_reasoning_parser_from_template("[THINK]x[/THINK]") == "mistral"
    assert choose_reasoning_parser_from_template("<|im_start|>{{ m.content }}") is None
    assert choose_reasoning_parser_from_template(None) is None
    assert choose_tool_parser_from_template("<tool_call>\\n<function={{ name }}>\\n<parameter=") == "qwen3_coder"
    assert choose_tool_parser_from_template("<tools></tools> <tool_call></tool_call>") == "hermes"
    assert choose_tool_parser_from_template("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert choose_tool_parser_from_template("<|python_start|>") == "pythonic"
    assert choose_tool_parser_from_template("ipython [func_name1(params_name1=params_value1), func_name2(params)]") == "pythonic"
    assert choose_tool_parser_from_template('ipython {"name": function name, "parameters": ...}') == "llama3_json"
    assert choose_tool_parser_from_template("{{ messages }}") is None


def grammar(constraint: dict):
    (kind, value), = constraint.items()
    return xgr.Grammar.from_structural_tag(value) if kind == "structural_tag" else xgr.Grammar.from_ebnf(value)


def test_a_constraint_starts_after_the_reasoning():
    qwen3 = get_reasoning_parser("qwen3")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for constraint in (Constraint.json_schema(schema), Constraint.regex(r'\{"a": [0-9]+\}'),
                       Constraint.grammar('root ::= "{\\"a\\": " [0-9]+ "}"'), Constraint.choice(['{"a": 1}']),
                       Constraint.structural_tag({"type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema}})):
        assert constrain_after_reasoning(constraint, qwen3, CONTENT) is constraint
        opened = constrain_after_reasoning(constraint, qwen3, REASONING)
        g = xgr.Grammar.from_structural_tag(opened.value)
        assert accepts(g, 'free <b>text</b>, {"not": json}</think>{"a": 1}')
        assert not accepts(g, 'thought</think>{"b": 1}') and not accepts(g, '{"a": 1}')
        maybe = xgr.Grammar.from_structural_tag(constrain_after_reasoning(constraint, qwen3, MAYBE).value)
        assert accepts(maybe, '{"a": 1}') and accepts(maybe, '<think>why</think>{"a": 1}')
        assert not accepts(maybe, 'why</think>{"a": 1}')
    assert accepts(xgr.Grammar.from_structural_tag(
        constrain_after_reasoning(Constraint.json_object(), qwen3, REASONING).value), 'x</think>{"b": [1]}')


def test_chat_template_kwargs_reach_the_template():
    tokenizer = load_tokenizer(model_files.resolve_model(None))
    tokenizer.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                               "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")

    def chat(**kwargs):
        req = GenerateParams(chat_template_kwargs=kwargs or None).fill(
            pb.GenerateRequest(chat=pb.Chat(messages=chat_messages([{"role": "user", "content": "hi"}]))))
        return req.chat

    assert tokenizer.decode(chat_token_ids(chat(), tokenizer, "prompt.chat")) == "hi"
    assert tokenizer.decode(chat_token_ids(chat(enable_thinking=False), tokenizer, "prompt.chat")) == "hi<think></think>"
    for bad in ({"tokenize": True}, {"not a name": 1}):
        with pytest.raises(InvalidArgument, match="prompt.chat.chat_template_kwargs"):
            chat_token_ids(chat(**bad), tokenizer, "prompt.chat")
    broken = chat()
    broken.chat_template_kwargs = "[1]"
    with pytest.raises(InvalidArgument, match="prompt.chat.chat_template_kwargs: must be a JSON object"):
        chat_token_ids(broken, tokenizer, "prompt.chat")


# -- tool calls ------------------------------------------------------------------------

# each format: free text with the two calls (content before them), and what its constraint writes
FORMATS = {
    "hermes": ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}',
                    '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}'),
    "mistral": ('Let me look. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}, "id": "abcdefghi"}]',
                '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]'),
    "qwen3_coder": ('Let me look. <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
                    '<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n'
                    '<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>',
                    '<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
                    '<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n'
                    '<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>'),
    "pythonic": ('[get_weather(city="Paris", days=2), get_time(zone=\'CET\')]',
                 '[get_weather(city="Paris", days=2), get_time(zone="CET")]'),
}
CONTENT_BEFORE = {"hermes": "Let me look. ", "mistral": "Let me look. ", "qwen3_coder": "Let me look. "}


def streamed(parser, text_pieces, parallel=True):
    stream = ToolCallStream(parser, TOOLS, parallel)
    deltas = [stream.feed(p) for p in text_pieces] + [stream.finish()]
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert len({c["id"] for c in calls}) == len(calls)
    return content or None, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_is_read_whole_and_streamed_in_any_chunking(name):
    parser = get_tool_parser(name)
    free, constrained = FORMATS[name]
    for text in (free, constrained):
        content, calls = parser.parse(text, TOOLS)
        assert calls == CALLS and content == (CONTENT_BEFORE.get(name) if text is free else None), (content, calls)
        for pieces in chunkings(text):
            assert streamed(parser, pieces) == (content, calls), pieces
        assert streamed(parser, [text], parallel=False) == (content, calls[:1])
    plain = "The weather in Paris is sunny; {braces} and [brackets] <tool or not>"
    assert parser.parse(plain, TOOLS) == (plain, [])
    for pieces in chunkings(plain):
        assert streamed(parser, pieces) == (plain, [])


def test_streamed_calls_arrive_as_each_closes_and_text_streams_before():
    stream = ToolCallStream(get_tool_parser("hermes"), TOOLS)
    assert stream.feed("Sure <tool") == {"content": "Sure "}  # "<tool" may begin a call: held
    assert stream.feed('_call>{"name": "get_time", "arguments": {"zone": "CET"}}') == {}
    first = stream.feed("</tool_call>\n<tool_call>")
    assert [c["function"]["name"] for c in first["tool_calls"]] == ["get_time"] and first["tool_calls"][0]["index"] == 0
    last = stream.finish()  # an empty unclosed call at the end: nothing more
    assert last == {} and stream.num_calls == 1


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_constraint_accepts_its_format_and_the_parser_reads_it(name):
    parser = get_tool_parser(name)
    constrained = FORMATS[name][1]
    required = grammar(parser.constraint(TOOLS))
    assert accepts(required, constrained)
    assert not accepts(required, "") and not accepts(required, "Sure.")
    one = grammar(parser.constraint(TOOLS, parallel=False))
    assert not accepts(one, constrained)
    single = parser.parse(constrained, TOOLS)[1][:1]
    named = grammar(parser.constraint(TOOLS, function="get_weather"))
    firsts = {"hermes": constrained.split("\n<tool_call>\n{\"name\": \"get_time\"")[0],
              "llama3_json": constrained.split("; ")[0],
              "mistral": constrained.split(", {\"name\": \"get_time\"")[0] + "]",
              "qwen3_coder": constrained.split("\n<tool_call>\n<function=get_time>")[0],
              "pythonic": constrained.split(", get_time")[0] + "]"}
    first = firsts[name]
    assert accepts(one, first) and accepts(named, first), first
    assert parser.parse(first, TOOLS)[1] == single == CALLS[:1]
    wrong_type = {"qwen3_coder": ("\n2\n", "\ntwo\n"), "pythonic": ("days=2", 'days="two"')}.get(name, ('"days": 2', '"days": "two"'))
    assert wrong_type[0] in first and not accepts(named, first.replace(*wrong_type))
    no_city = {"qwen3_coder": ("<parameter=city>\nParis\n</parameter>\n", ""), "pythonic": ('city="Paris", ', "")}.get(
        name, ('"city": "Paris", ', ""))
    assert no_city[0] in first and not accepts(named, first.replace(*no_city))  # "city" is required


def test_tool_parsers_are_vllms_names_and_unknown_ones_are_refused():
    assert list(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic"]
    with pytest.raises(KeyError, match="hermes"):
        get_tool_parser("xml")
    mistral_new = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}'
    assert get_tool_parser("mistral").parse(mistral_new, TOOLS) == (None, CALLS)
    assert get_tool_parser("qwen3_coder").parse(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "</function>", TOOLS)[1] == [("get_weather", json.dumps({"city": "42", "days": 3}))]  # typed by the schema
    enums = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["CET", "UTC"]}, "n": {"enum": [1, 2]}}}}}]
    assert get_tool_parser("qwen3_coder").parse(
        "<function=f>\n<parameter=zone>\nUTC \n</parameter><parameter=n> 2\n\n</parameter>\n</function>",
        enums)[1] == [("f", '{"zone": "UTC", "n": 2}')]  # blanks the grammar allows around a value
    assert get_tool_parser("pythonic").parse("[get_weather(city=open('x'))]") == ("[get_weather(city=open('x'))]", [])
