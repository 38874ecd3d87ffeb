"""Structured output and tool calls in the gateway, without a service: OpenAI's fields to one
constraint (and the field an error names), tools into messages, and the model's tool-call text
back to OpenAI's `tool_calls`, streamed or not."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest
from pydantic import ValidationError

from gateway_svc.errors import GatewayError, validation_error
from gateway_svc.schemas import ChatCompletionRequest, CompletionRequest
from gateway_svc.tools import ToolDeltas, parse_hermes, read_output, required_schema, structured
from gateway_svc.translate import chat_messages, chat_params, completion_params
from pagoda.client import PagodaError
from pagoda.tool_parsers import get_tool_parser
from tests.structured_reference import LABEL_SCHEMA, WEATHER_TOOL

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "the local time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def test_each_field_becomes_its_constraint_and_names_itself():
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "l", "schema": LABEL_SCHEMA, "strict": True}}},
         "response_format", "json_schema", LABEL_SCHEMA),
        ({"response_format": {"type": "json_object"}}, "response_format", "json_object", True),
        ({"structured_outputs": {"json": '{"type": "integer"}'}}, "structured_outputs.json", "json_schema", '{"type": "integer"}'),
        ({"structured_outputs": {"regex": r"\d+"}}, "structured_outputs.regex", "regex", r"\d+"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "structured_outputs.choice", "choice", ["yes", "no"]),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "structured_outputs.grammar", "grammar", 'root ::= "a"'),
        ({"guided_regex": "a+"}, "guided_regex", "regex", "a+"),
        ({"tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         "tools[1].function.parameters", "structural_tag",
         get_tool_parser("hermes").constraint([WEATHER_TOOL, TIME_TOOL], function="get_time")["structural_tag"]),
        ({"tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": "required"}, "tools", "structural_tag",
         get_tool_parser("hermes").constraint([WEATHER_TOOL, TIME_TOOL])["structural_tag"]),
    ]
    for fields, param, kind, value in cases:
        s = structured(chat(**fields))
        assert (s.param, s.params) == (param, {kind: value}), fields
        assert getattr(chat_params(chat(**fields), s.params), kind) == value
    assert structured(chat(response_format={"type": "text"})).params == {}
    completion = CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "json_object"}})
    assert completion_params(completion, structured(completion).params).json_object


def test_two_constraints_or_a_bad_tool_choice_are_a_400_naming_the_field():
    for fields, param in [
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tools[0].function.parameters"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools"),
    ]:
        with pytest.raises(GatewayError) as err:
            structured(chat(**fields))
        assert err.value.status == 400 and err.value.param == param, (fields, err.value.message)


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),  # without its json_schema
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER_TOOL] * 129}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"structured_outputs": {"json": {}, "regexp": "a"}}, "structured_outputs.regexp"),
])
def test_malformed_fields_are_refused_by_the_schema(fields, param):
    with pytest.raises(ValidationError) as err:
        chat(**fields)
    assert validation_error(err.value.errors()).param == param


def test_a_schema_the_scheduler_refuses_is_named_by_the_field_it_came_from():
    err = PagodaError('constraint.json_schema: does not compile: Unsupported type "foo"', grpc.StatusCode.INVALID_ARGUMENT)
    mapped = GatewayError.from_pagoda(err, chat=True, constraint="tools[0].function.parameters")
    assert (mapped.status, mapped.param) == (400, "tools[0].function.parameters")
    assert mapped.message == 'tools[0].function.parameters: does not compile: Unsupported type "foo"'
    other = PagodaError("sampling.top_p: must be in (0, 1]", grpc.StatusCode.INVALID_ARGUMENT)
    assert GatewayError.from_pagoda(other, chat=True, constraint="response_format").param == "top_p"


def test_the_required_schema_admits_calls_of_the_tools_only():
    for parallel in (True, False):
        schema = required_schema(chat(tools=[WEATHER_TOOL, TIME_TOOL]).tools, parallel)
        one = [{"name": "get_weather", "parameters": {"city": "Paris"}}]
        jsonschema.validate(one, schema)
        two = one + [{"name": "get_time", "parameters": {"zone": "CET"}}]
        for bad in ([], [{"name": "get_weather", "parameters": {"zone": "CET"}}], [{"name": "rm", "parameters": {}}],
                    *([] if parallel else [two])):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, schema)
        if parallel:
            jsonschema.validate(two, schema)


def test_past_calls_and_tool_answers_are_kept_for_the_template():
    history = [
        {"role": "system", "content": "Be brief."}, *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    req = chat(messages=history, tools=[WEATHER_TOOL])
    messages = chat_messages(req)
    assert messages == [{**m, "content": m["content"] or ""} for m in history]
    assert structured(req).tools == (WEATHER_TOOL,)
    assert structured(chat(tools=[WEATHER_TOOL], tool_choice="none")).tools == ()
    bad = chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(GatewayError) as err:
        chat_messages(bad)
    assert err.value.param == "messages.0.tool_calls.0.function.arguments"


def test_hermes_tool_calls_are_parsed_and_other_text_kept():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}'  # the last one unclosed (EOS)
    assert parse_hermes(text) == ("Let me check.\n", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')])
    assert parse_hermes("no calls here") == ("no calls here", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_hermes(broken) == (broken, [])
    assert parse_hermes('<tool_call>{"arguments": {}}</tool_call>')[1] == []  # no name
    auto = structured(chat(tools=[WEATHER_TOOL]))
    assert [c["function"]["name"] for c in read_output(auto, text)[1]] == ["get_weather", "get_time"]
    assert [c["function"]["name"] for c in read_output(auto, text, parallel=False)[1]] == ["get_weather"]


@pytest.mark.parametrize("mode,text", [
    ("auto", 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("auto", "Paris is sunny, I think; < is not a tag"),
    ("required", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'),
    ("named", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'),
])
def test_streamed_deltas_reassemble_to_the_unstreamed_answer(mode, text):
    choice = {"type": "function", "function": {"name": "get_time"}} if mode == "named" else mode
    s = structured(chat(tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice))
    content, calls = read_output(s, text)
    deltas = ToolDeltas(s, parallel=True)
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    streamed_content, streamed_calls = "", {}
    for i, piece in enumerate(pieces):
        delta = deltas.add(piece, i == len(pieces) - 1)
        streamed_content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            got = streamed_calls.setdefault(call["index"], {"id": call.get("id"), "name": "", "arguments": ""})
            got["name"] += call["function"].get("name", "")
            got["arguments"] += call["function"].get("arguments", "")
            assert got["id"] and ("id" not in call or call["id"] == got["id"])
    assert deltas.num_calls == len(calls) == len(streamed_calls)
    assert [(c["name"], c["arguments"]) for c in streamed_calls.values()] == \
           [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert streamed_content == (content or "")
    assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)
