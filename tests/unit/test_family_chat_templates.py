"""Each tool-call format with its family's chat template (tests/data/chat_templates/), no service:
the scheduler chooses the format's parser from the template, the template renders the tools and
a tool-call history (an assistant's calls, the tools' results) as the scheduler hands them over,
and the calls it writes into that history are the calls the parser reads back (the model is
shown calls in the very form its answers are read in). The calls the model writes under the
gateway's constraint, forced and free, are tests/gateway/test_reasoning_and_tool_formats.py's.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagoda import model_files
from pagoda.reasoning import choose_reasoning_parser_from_template
from pagoda.tool_parsers import TOOL_PARSERS, call_id, choose_tool_parser_from_template, get_tool_parser
from scheduler_svc.errors import InvalidArgument
from tests.chat_templates import FAMILY_TEMPLATES, end_of_turn, family_template, render, with_template

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ARGUMENTS = '{"city": "Paris", "days": 2}'


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(model_files.resolve_model(None, weights=False))


def history(parser: str) -> list[dict]:
    """A user's question, the assistant's call (its id as the gateway makes them for `parser`), the result."""
    cid = call_id(parser)
    return [
        {"role": "user", "content": "What will the weather be in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": cid, "content": "Sunny, 24 degrees"},
    ]


def test_every_format_has_its_familys_template():
    assert set(FAMILY_TEMPLATES) == set(TOOL_PARSERS)


@pytest.mark.parametrize("parser", list(FAMILY_TEMPLATES))
def test_the_scheduler_chooses_the_formats_parser_from_its_familys_template(parser):
    template = family_template(parser)
    assert choose_tool_parser_from_template(template) == parser
    assert choose_reasoning_parser_from_template(template) is None  # none of these thinks


@pytest.mark.parametrize("parser", list(FAMILY_TEMPLATES))
def test_the_template_renders_tools_and_a_tool_call_history(tokenizer, parser):
    tok = with_template(tokenizer, family_template(parser))
    text = tok.decode(render(tok, history(parser), TOOLS))
    for tool in TOOLS:  # every tool is described to the model, its parameters too
        name = tool["function"]["name"]
        assert name in text and all(p in text for p in tool["function"]["parameters"]["properties"])
    assert "Sunny, 24 degrees" in text and "What will the weather be in Paris?" in text


@pytest.mark.parametrize("parser", list(FAMILY_TEMPLATES))
def test_the_calls_a_template_writes_are_the_calls_its_parser_reads(tokenizer, parser):
    """The assistant's turn the template writes for a call, after the generation prompt it writes
    for the question, read by the format's parser: the same function and arguments, no content."""
    tok = with_template(tokenizer, family_template(parser))
    messages = history(parser)
    prompt = tok.decode(render(tok, messages[:1], TOOLS))
    turn = tok.decode(render(tok, messages[:2], TOOLS, add_generation_prompt=False))
    assert turn.startswith(prompt), (prompt, turn)
    written = turn[len(prompt):]
    end = end_of_turn(parser, tok)
    assert written.rstrip().endswith(end), written
    answer = written.rstrip()[:-len(end)]  # what the model writes before its end of turn
    content, calls = get_tool_parser(parser).parse(answer, TOOLS)
    assert (content, calls) == (None, [("get_weather", ARGUMENTS)]), answer


def test_mistrals_template_takes_the_gateways_call_ids_and_refuses_short_ones(tokenizer):
    tok = with_template(tokenizer, family_template("mistral"))
    messages = history("mistral")
    cid = messages[1]["tool_calls"][0]["id"]
    assert len(cid) == 9 and cid.isalnum()
    assert f'"call_id": "{cid}"' in tok.decode(render(tok, messages, TOOLS))
    messages[1]["tool_calls"][0]["id"] = messages[2]["tool_call_id"] = "call_1"
    with pytest.raises(InvalidArgument) as err:  # the scheduler's INVALID_ARGUMENT, naming the field
        render(tok, messages, TOOLS)
    assert err.value.field == "prompt.chat.messages" and "length >= 9" in err.value.message


def test_llama31s_template_refuses_two_calls_in_one_turn(tokenizer):
    tok = with_template(tokenizer, family_template("llama3_json"))
    messages = history("llama3_json")
    messages[1]["tool_calls"].append({"id": "call_2", "type": "function",
                                      "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}})
    with pytest.raises(InvalidArgument, match="single tool-calls"):
        render(tok, messages[:2], TOOLS)
