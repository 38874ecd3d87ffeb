"""The Responses and Messages APIs' requests as chat messages, and their streamed events, without a
service (tests/gateway/test_agent_apis.py runs them against one)."""

from __future__ import annotations

import json

import pytest

from gateway_svc.agent_chat import Delta, ToolCallDelta
from gateway_svc.errors import GatewayError
from gateway_svc.messages import EventWriter as MessageEvents
from gateway_svc.messages import MessagesRequest, chat_request
from gateway_svc.responses import EventWriter as ResponseEvents
from gateway_svc.responses import input_messages


def test_function_calls_join_the_assistant_turn_and_reasoning_items_stay_out():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"role": "developer", "content": "be brief"}]
    assert input_messages(items) == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "system", "content": "be brief"}]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("item,param", [
    ({"type": "function_call_output", "output": "x"}, "input[0].call_id"),
    ({"type": "function_call", "call_id": "c", "arguments": "{}"}, "input[0].name"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input[0].content[0]"),
    ({"role": "user", "content": [{"type": "input_text"}]}, "input[0].content[0].text"),
    ({"role": "user", "content": 3}, "input[0].content"),
    ({"type": "item_reference", "id": "x"}, "input[0].type"),
])
def test_malformed_items_are_a_400_naming_them(item, param):
    with pytest.raises(GatewayError) as err:
        input_messages([item])
    assert (err.value.status, err.value.param) == (400, param)


def messages(*blocks_by_turn, **fields) -> list[dict]:
    body = MessagesRequest.model_validate({"max_tokens": 8, "messages": [
        {"role": role, "content": content} for role, content in blocks_by_turn], **fields})
    return [m.model_dump(exclude_none=True) for m in chat_request(body).messages]


def test_anthropic_blocks_become_the_chat_messages_of_the_same_turns():
    got = messages(("user", "Weather?"),
                   ("assistant", [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                  {"type": "text", "text": "Looking."},
                                  {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}}]),
                   ("user", [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sun"}]},
                             {"type": "text", "text": "And tomorrow?"}]),
                   system=[{"type": "text", "text": "Be brief."}])
    assert [(m["role"], m.get("content")) for m in got] == [
        ("system", "Be brief."), ("user", "Weather?"), ("assistant", "Looking."), ("tool", "sun"),
        ("user", "And tomorrow?")]
    assert json.loads(got[2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert got[3]["tool_call_id"] == "t1"


def test_tool_choice_and_thinking_map_to_chats_fields():
    def chat(**fields):
        body = MessagesRequest.model_validate({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
                                               "tools": [{"name": "w", "input_schema": {"type": "object"}}], **fields})
        return chat_request(body)
    assert chat(tool_choice={"type": "any"}).tool_choice == "required"
    assert chat(tool_choice={"type": "tool", "name": "w"}).tool_choice.function.name == "w"
    assert chat(tool_choice={"type": "auto", "disable_parallel_tool_use": True}).parallel_tool_calls is False
    assert chat(thinking={"type": "disabled"}).chat_template_kwargs == {"enable_thinking": False}
    assert chat(thinking={"type": "enabled", "budget_tokens": 1024}).chat_template_kwargs == {"enable_thinking": True}
    with pytest.raises(GatewayError) as err:
        chat(tool_choice={"type": "tool"})
    assert err.value.param == "tool_choice.name"


def _events(sse: list[str]) -> list[dict]:
    return [json.loads(e.split("data: ", 1)[1]) for e in sse]


def test_response_events_open_and_close_each_item_in_order():
    writer = ResponseEvents()
    sse = writer.delta(Delta(reasoning="think"))
    sse += writer.delta(Delta(text="Hi"))
    sse += writer.delta(Delta(text=" there", tool_calls=(ToolCallDelta(0, '{"a"', "call_1", "f"),)))
    sse += writer.delta(Delta(tool_calls=(ToolCallDelta(0, ": 1}"),)))
    sse += writer.close()
    events = _events(sse)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in writer.output] == [("reasoning", "completed"), ("message", "completed"),
                                                                   ("function_call", "completed")]
    assert writer.output[1]["content"][0]["text"] == "Hi there"
    assert (writer.output[2]["call_id"], writer.output[2]["arguments"]) == ("call_1", '{"a": 1}')


def test_message_events_open_one_block_per_kind():
    writer = MessageEvents()
    sse = writer.delta(Delta(reasoning="hm")) + writer.delta(Delta(text="Hi"))
    sse += writer.delta(Delta(tool_calls=(ToolCallDelta(0, '{"a": 1}', "call_9", "f"),))) + writer.close()
    events = _events(sse)
    assert [(e["type"], e.get("index")) for e in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2)]
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == [
        "thinking_delta", "text_delta", "input_json_delta"]
    assert events[6]["content_block"] == {"type": "tool_use", "id": "toolu_9", "name": "f", "input": {}}
