"""OpenAI's Responses API and Anthropic's Messages API through the gateway, with the official
`openai` and `anthropic` packages as clients, against one real service (two API-key tenants).

Each answer, plain or streamed, equals the chat completion of the same messages (greedy), tool
calls included; a conversation continued by `previous_response_id` equals the chat of that history,
also after the gateway restarts (the scheduler keeps running); bad inputs are 4xx in each API's
error shape; count_tokens is the chat's prompt tokens.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import anthropic
import httpx2 as httpx
import jsonschema
import openai
import pytest

from tests.client.services import EXECUTOR_ARGS, target
from tests.gateway.gateway import Gateway
from tests.service.harness import Service
from tests.structured_reference import LABEL_SCHEMA, WEATHER_TOOL

pytestmark = pytest.mark.timeout(600)

KEY_A, KEY_B = "key-of-tenant-a-0123456789", "key-of-tenant-b-0123456789"
WEATHER = WEATHER_TOOL["function"]
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "the local time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
QUESTION = "Name three colors of the rainbow."
WEATHER_QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def workdir():
    """Its own folder, not pytest's tmp_path: pytest run elsewhere at the same time may prune
    those, and the gateway restarted below must find its database again."""
    path = Path(tempfile.mkdtemp(prefix="pagoda-agent-apis-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def svc(workdir):
    keys = workdir / "keys"
    keys.write_text(f"{KEY_A} tenant-a\n{KEY_B} tenant-b\n")
    with Service(scheduler_args=["--api-key-file", str(keys)], executor_args=EXECUTOR_ARGS, api_key=KEY_A) as service:
        yield service


@pytest.fixture(scope="module")
def gateway(svc, workdir):
    with Gateway(target(svc), ["--responses-db", str(workdir / "responses.sqlite3")]) as gw:
        yield gw


def _openai(gateway, key):
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(gateway):
    return _openai(gateway, KEY_A)


@pytest.fixture(scope="module")
def claude(gateway):
    return anthropic.Anthropic(base_url=gateway.url, api_key=KEY_A, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(oai):
    return oai.models.list().data[0].id


def chat(oai, model_name, messages, **kwargs):
    return oai.chat.completions.create(model=model_name, messages=messages, temperature=0, **kwargs)


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


# -- /v1/responses ---------------------------------------------------------------------------------


def test_a_response_equals_the_chat_completion_plain_and_streamed(oai, model_name):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]
    want = chat(oai, model_name, messages, max_completion_tokens=24)
    kwargs = dict(model=model_name, instructions="Answer briefly.", input=QUESTION, max_output_tokens=24, temperature=0)
    reply = oai.responses.create(**kwargs)
    assert reply.output_text == want.choices[0].message.content
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (want.usage.prompt_tokens,
                                                                     want.usage.completion_tokens)
    [item] = reply.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert reply.status == ("incomplete" if want.choices[0].finish_reason == "length" else "completed")

    events = list(oai.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == want.choices[0].message.content
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text
    completed = events[-1].response
    assert completed.output_text == text and completed.usage.output_tokens == want.usage.completion_tokens


def test_input_items_are_the_chat_messages_they_name(oai, model_name):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": WEATHER_QUESTION},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
                {"role": "user", "content": "And what should I wear?"}]
    want = chat(oai, model_name, messages, max_tokens=16, tools=[WEATHER_TOOL])
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": WEATHER_QUESTION}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
             {"role": "user", "content": "And what should I wear?"}]
    reply = oai.responses.create(model=model_name, input=items, max_output_tokens=16, temperature=0,
                                 tools=[{"type": "function", **WEATHER}], store=False)
    assert reply.output_text == (want.choices[0].message.content or "")
    calls = [(i.name, i.arguments) for i in reply.output if i.type == "function_call"]
    assert calls == calls_of(want.choices[0].message)
    assert reply.usage.input_tokens == want.usage.prompt_tokens


def test_previous_response_id_continues_the_conversation_also_after_a_gateway_restart(oai, gateway, model_name):
    first = oai.responses.create(model=model_name, input="Say hello.", max_output_tokens=8, temperature=0)
    second = oai.responses.create(model=model_name, previous_response_id=first.id, input="Now say goodbye.",
                                  max_output_tokens=8, temperature=0)
    history = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "Now say goodbye."}]
    want = chat(oai, model_name, history, max_tokens=8)
    assert second.output_text == want.choices[0].message.content
    assert second.previous_response_id == first.id

    gateway.__exit__()
    gateway.__enter__()  # the same port and --responses-db; the scheduler kept running
    assert oai.responses.retrieve(first.id).output_text == first.output_text
    third = oai.responses.create(model=model_name, previous_response_id=second.id, input="Once more.",
                                 max_output_tokens=8, temperature=0, stream=True)
    text = "".join(e.delta for e in third if e.type == "response.output_text.delta")
    history += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Once more."}]
    assert text == chat(oai, model_name, history, max_tokens=8).choices[0].message.content

    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)


def test_another_tenants_response_is_unknown(oai, gateway, model_name):
    mine = oai.responses.create(model=model_name, input="Say hello.", max_output_tokens=4, temperature=0)
    theirs = _openai(gateway, KEY_B)
    with pytest.raises(openai.NotFoundError) as err:
        theirs.responses.retrieve(mine.id)
    assert err.value.body["message"] == f"Response with id '{mine.id}' not found."
    with pytest.raises(openai.NotFoundError) as err:
        theirs.responses.create(model=model_name, previous_response_id=mine.id, input="Go on.", max_output_tokens=4)
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(mine.id)
    assert oai.responses.retrieve(mine.id).id == mine.id  # still there for its own tenant
    unstored = oai.responses.create(model=model_name, input="Hi.", max_output_tokens=2, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


def test_forced_and_free_tool_calls_equal_the_chat_completions(oai, model_name):
    chat_tools = [TIME_TOOL, WEATHER_TOOL]
    tools = [{"type": "function", **t["function"]} for t in chat_tools]
    question = [{"role": "user", "content": WEATHER_QUESTION}]
    for chat_choice, choice in [({"type": "function", "function": {"name": "get_weather"}},
                                 {"type": "function", "name": "get_weather"}),
                                ("required", "required"), ("auto", "auto")]:
        want = chat(oai, model_name, question, max_tokens=64, tools=chat_tools, tool_choice=chat_choice)
        kwargs = dict(model=model_name, input=WEATHER_QUESTION, max_output_tokens=64, temperature=0, tools=tools,
                      tool_choice=choice, store=False)
        reply = oai.responses.create(**kwargs)
        calls = [(i.name, i.arguments) for i in reply.output if i.type == "function_call"]
        assert calls == calls_of(want.choices[0].message), choice
        assert reply.output_text == (want.choices[0].message.content or ""), choice
        if choice != "auto":
            assert calls
            for name, arguments in calls:
                jsonschema.validate(json.loads(arguments), {t["name"]: t["parameters"] for t in tools}[name])

        events = list(oai.responses.create(stream=True, **kwargs))
        streamed: dict[str, str] = {}
        for e in events:
            if e.type == "response.function_call_arguments.delta":
                streamed[e.item_id] = streamed.get(e.item_id, "") + e.delta
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [(e.name, e.arguments) for e in done] == calls, choice
        assert [streamed.get(e.item_id, "") for e in done] == [a for _, a in calls]
        assert [(i.name, i.arguments) for i in events[-1].response.output if i.type == "function_call"] == calls


def test_text_format_json_schema_equals_the_chat_response_format(oai, model_name):
    messages = [{"role": "user", "content": "Classify: I love this."}]
    want = chat(oai, model_name, messages, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "label", "schema": LABEL_SCHEMA}})
    reply = oai.responses.create(model=model_name, input=messages[0]["content"], max_output_tokens=40, temperature=0,
                                 text={"format": {"type": "json_schema", "name": "label", "schema": LABEL_SCHEMA}},
                                 store=False)
    assert reply.output_text == want.choices[0].message.content
    assert reply.text.format.type == "json_schema"


def test_bad_responses_inputs_are_a_4xx_naming_the_field(oai, model_name):
    cases = [
        (dict(input="Hi", previous_response_id="resp_unknown"), openai.NotFoundError, "previous_response_id"),
        (dict(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), openai.BadRequestError,
         "input[0].call_id"),
        (dict(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"}]),
         openai.BadRequestError, "input[0].arguments"),
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]),
         openai.BadRequestError, "input[0].content[0].image_url"),
        (dict(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]),
         openai.BadRequestError, "input[0].content[0]"),
        (dict(input=[{"type": "web_search_call"}]), openai.BadRequestError, "input[0].type"),
        (dict(input=[{"role": "robot", "content": "hi"}]), openai.BadRequestError, "input[0].role"),
        (dict(input="Hi", tools=[{"type": "function", "name": "f"}], tool_choice={"type": "function", "name": "g"}),
         openai.BadRequestError, "tool_choice"),
        (dict(input="Hi", max_output_tokens=0), openai.BadRequestError, "max_output_tokens"),
        (dict(input="Hi", extra_body={"frobnicate": 1}), openai.BadRequestError, "frobnicate"),
    ]
    for kwargs, error, param in cases:
        for stream in (False, True):
            with pytest.raises(error) as err:
                oai.responses.create(model=model_name, temperature=0, stream=stream, **kwargs)
            assert err.value.body["param"] == param, (kwargs, err.value.body)


# -- /v1/messages ----------------------------------------------------------------------------------


def greedy(**kwargs) -> dict:
    return {"extra_body": {"temperature": 0, **kwargs}}


def test_a_message_equals_the_chat_completion_plain_and_streamed(oai, claude, model_name):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]
    want = chat(oai, model_name, messages, max_tokens=24)
    kwargs = dict(model=model_name, max_tokens=24, system="Answer briefly.",
                  messages=[{"role": "user", "content": QUESTION}], **greedy())
    reply = claude.messages.create(**kwargs)
    assert [b.type for b in reply.content] == ["text"]
    assert reply.content[0].text == want.choices[0].message.content
    assert reply.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want.choices[0].finish_reason]
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert reply.usage.output_tokens == want.usage.completion_tokens
    raw = list(claude.messages.create(stream=True, **kwargs))  # the SDK passes over pings
    kinds = [e.type for e in raw]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in raw[2:-3]) == reply.content[0].text
    start = raw[0].message.usage
    assert start.input_tokens + start.cache_read_input_tokens == want.usage.prompt_tokens
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == reply.content[0].text and final.stop_reason == reply.stop_reason
    assert final.usage.output_tokens == reply.usage.output_tokens

    bearer = anthropic.Anthropic(base_url=claude.base_url, auth_token=KEY_A, max_retries=0, timeout=120)
    system_blocks = [{"type": "text", "text": "Answer briefly."}]
    assert bearer.messages.create(**{**kwargs, "system": system_blocks}).content[0].text == reply.content[0].text


def test_a_stop_sequence_ends_the_message_with_its_stop_reason(oai, claude, model_name):
    messages = [{"role": "user", "content": QUESTION}]
    full = chat(oai, model_name, messages, max_tokens=24).choices[0].message.content
    stop = full.split()[1]
    reply = claude.messages.create(model=model_name, max_tokens=24, messages=messages, stop_sequences=[stop],
                                   **greedy())
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
    assert reply.content[0].text == full[: full.index(stop)]


def test_message_tool_use_equals_the_chat_tool_calls(oai, claude, model_name):
    chat_tools = [TIME_TOOL, WEATHER_TOOL]
    tools = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
              "input_schema": t["function"]["parameters"]} for t in chat_tools]
    question = [{"role": "user", "content": WEATHER_QUESTION}]
    for chat_choice, choice in [({"type": "function", "function": {"name": "get_weather"}},
                                 {"type": "tool", "name": "get_weather"}),
                                ("required", {"type": "any"}), ("auto", {"type": "auto"}), ("none", {"type": "none"})]:
        want = chat(oai, model_name, question, max_tokens=64, tools=chat_tools, tool_choice=chat_choice)
        kwargs = dict(model=model_name, max_tokens=64, messages=question, tools=tools, tool_choice=choice, **greedy())
        reply = claude.messages.create(**kwargs)
        uses = [(b.name, b.input) for b in reply.content if b.type == "tool_use"]
        assert uses == [(n, json.loads(a)) for n, a in calls_of(want.choices[0].message)], choice
        text = "".join(b.text for b in reply.content if b.type == "text")
        assert text == (want.choices[0].message.content or ""), choice
        finish = want.choices[0].finish_reason
        assert reply.stop_reason == {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}[finish]
        assert bool(uses) == (choice["type"] in ("tool", "any")), choice
        with claude.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
        assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == uses, choice

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*question, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    want = chat(oai, model_name, history, max_tokens=12, tools=chat_tools)
    blocks = [*question, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny, 21 C"}]}]
    reply = claude.messages.create(model=model_name, max_tokens=12, messages=blocks, tools=tools, **greedy())
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert "".join(b.text for b in reply.content if b.type == "text") == (want.choices[0].message.content or "")


def test_count_tokens_equals_the_chat_prompt_tokens(oai, claude, model_name):
    tools = [{"name": "get_weather", "input_schema": WEATHER["parameters"]}]
    messages = [{"role": "user", "content": WEATHER_QUESTION}]
    want = chat(oai, model_name, [{"role": "system", "content": "Be brief."}, *messages], max_tokens=1,
                tools=[WEATHER_TOOL])
    counted = claude.messages.count_tokens(model=model_name, system="Be brief.", messages=messages, tools=tools)
    assert counted.input_tokens == want.usage.prompt_tokens
    plain = chat(oai, model_name, messages, max_tokens=1)
    assert claude.messages.count_tokens(model=model_name, messages=messages).input_tokens == plain.usage.prompt_tokens


def test_bad_messages_inputs_are_a_4xx_in_anthropics_shape(gateway, claude, model_name):
    url = f"{gateway.url}/v1/messages"
    headers = {"x-api-key": KEY_A, "anthropic-version": "2023-06-01"}
    user = [{"role": "user", "content": "Hi"}]
    cases = [
        ({"model": model_name, "messages": user}, 400, "max_tokens"),
        ({"model": model_name, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": "AA=="}}]}]},
         400, "messages.0.content.0.source.media_type"),
        ({"model": model_name, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]},
         400, "messages.0.content.0"),
        ({"model": model_name, "max_tokens": 4, "messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f"}]}]}, 400, "messages.0.content.0"),
        ({"model": model_name, "max_tokens": 4, "messages": user, "tool_choice": {"type": "tool"}}, 400,
         "tool_choice.name"),
        ({"model": model_name, "max_tokens": 4, "messages": user, "tool_choice": {"type": "tool", "name": "nope"},
          "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, 400, "tool_choice"),
        ({"model": "no-such-model", "max_tokens": 4, "messages": user}, 404, "The model `no-such-model`"),
    ]
    for body, status, field in cases:
        for stream in (False, True):
            reply = httpx.post(url, json={**body, "stream": stream}, headers=headers, timeout=60)
            assert reply.status_code == status, (body, reply.text)
            error = reply.json()
            assert error["type"] == "error" and error["error"]["message"].startswith(field), (body, error)
            assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    wrong = httpx.post(url, json={"model": model_name, "max_tokens": 4, "messages": user},
                       headers={**headers, "x-api-key": "wrong"}, timeout=60)
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=model_name, max_tokens=0, messages=user)
    assert err.value.body["error"]["type"] == "invalid_request_error"


# -- the reasoning split ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_gateway(svc, workdir):
    """A second gateway on the same service whose reasoning parser (deepseek_r1: reasoning until
    `</think>`, opened or not) makes the whole of SmolLM2's answer reasoning."""
    args = ["--reasoning-parser", "deepseek_r1", "--responses-db", str(workdir / "thinking.sqlite3")]
    with Gateway(target(svc), args) as gw:
        yield gw


def test_the_reasoning_is_a_reasoning_item_and_a_thinking_block(thinking_gateway, model_name):
    oai = _openai(thinking_gateway, KEY_A)
    messages = [{"role": "user", "content": QUESTION}]
    want = chat(oai, model_name, messages, max_tokens=12).choices[0].message
    reasoning = want.model_extra["reasoning_content"]
    assert reasoning and not want.content

    reply = oai.responses.create(model=model_name, input=QUESTION, max_output_tokens=12, temperature=0, store=False)
    assert [(i.type, [c.text for c in i.content]) for i in reply.output] == [("reasoning", [reasoning])]
    # every output token is the reasoning's here (the scheduler counts them as the split is made)
    assert reply.usage.output_tokens_details.reasoning_tokens == reply.usage.output_tokens == 12
    events = list(oai.responses.create(model=model_name, input=QUESTION, max_output_tokens=12, temperature=0,
                                       store=False, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [reasoning]
    assert events[-1].response.output[0].content[0].text == reasoning

    claude = anthropic.Anthropic(base_url=thinking_gateway.url, api_key=KEY_A, max_retries=0, timeout=120)
    kwargs = dict(model=model_name, max_tokens=12, messages=messages, **greedy())
    message = claude.messages.create(**kwargs)
    assert [(b.type, b.thinking) for b in message.content] == [("thinking", reasoning)]
    raw = list(claude.messages.create(stream=True, **kwargs))
    assert raw[1].content_block.type == "thinking"
    assert "".join(e.delta.thinking for e in raw if e.type == "content_block_delta") == reasoning
    with claude.messages.stream(**kwargs) as stream:
        assert stream.get_final_message().content[0].thinking == reasoning
