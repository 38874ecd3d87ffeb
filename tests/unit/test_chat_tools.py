"""Tools and tool calls in `pagoda.v1.Chat` reach the chat template: a template that reads tools
gets them (and the calls) as transformers' apply_chat_template takes them; one that does not gets
them written in the Hermes form; bad JSON is INVALID_ARGUMENT naming the field."""

import copy
import json

import pytest

from gateway_svc.tools import parse_hermes
from pagoda import model_files
from pagoda.client.types import GenerateParams, chat_messages
from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.tokenizer import load_tokenizer
from scheduler_svc.validation import chat_token_ids

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
# A template that reads tools and tool calls, as Qwen's and Llama 3's do (shortened).
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %}[answers {{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(model_files.resolve_model(None))


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer):
    t = copy.deepcopy(tokenizer)
    t.chat_template = TOOL_TEMPLATE
    return t


def chat(messages, tools=()):
    req = GenerateParams(tools=tools).fill(pb.GenerateRequest(chat=pb.Chat(messages=chat_messages(messages))))
    return req.chat


def text(tokenizer, ids):
    return tokenizer.decode(ids)


def test_a_template_that_reads_tools_gets_them_and_the_calls(tool_tokenizer):
    rendered = text(tool_tokenizer, chat_token_ids(chat(HISTORY, [WEATHER]), tool_tokenizer, "prompt.chat"))
    assert rendered.startswith("TOOLS " + json.dumps([WEATHER]))
    assert '[call call_1 get_weather {"city": "Paris"}]' in rendered  # arguments as an object
    assert "<tool>sunny[answers call_1]" in rendered
    assert rendered.endswith("<assistant>")


def test_a_template_without_tools_gets_them_in_the_hermes_form(tokenizer):
    ids = chat_token_ids(chat(HISTORY, [WEATHER]), tokenizer, "prompt.chat")
    rendered = text(tokenizer, ids)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in rendered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered
    assistant = rendered.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_hermes(assistant) == ("", [("get_weather", '{"city": "Paris"}')])
    plain = [{"role": m["role"], "content": m["content"] or ""} for m in HISTORY]
    assert chat_token_ids(chat(plain), tokenizer, "prompt.chat") == tokenizer.apply_chat_template(
        plain, tokenize=True, add_generation_prompt=True, return_dict=False)  # no tools: as before


@pytest.mark.parametrize("field, messages, tools", [
    ("prompt.chat.tools[0].parameters", HISTORY[:1], [{"name": "f", "parameters": "{oops"}]),
    ("prompt.chat.tools[0].parameters", HISTORY[:1], [{"name": "f", "parameters": "[1]"}]),
    ("prompt.chat.tools[1].name", HISTORY[:1], [WEATHER, {"name": ""}]),
    ("prompt.chat.messages[0].tool_calls[0].arguments",
     [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}], []),
    ("prompt.chat.tools", HISTORY[:1], [{"name": f"f{i}"} for i in range(129)]),
])
def test_bad_tools_are_invalid_argument_naming_the_field(tokenizer, field, messages, tools):
    with pytest.raises(InvalidArgument) as err:
        chat_token_ids(chat(messages, tools), tokenizer, "prompt.chat")
    assert err.value.field == field


def test_tools_need_a_chat_prompt():
    with pytest.raises(ValueError, match="chat prompt"):
        GenerateParams(tools=[WEATHER]).fill(pb.GenerateRequest(text="hi"))
