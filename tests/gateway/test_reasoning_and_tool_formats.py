"""Reasoning and each family's tool-call format through the gateway, with the official `openai`
package, on one service: a tiny random Llama whose chat template thinks as Qwen3's does (it
opens `<think>`, or closes it at once with `enable_thinking: false`) and describes tools in the
Hermes form. The scheduler chooses its parsers from that template (qwen3, hermes); one gateway
more per other tool-call format (`--tool-call-parser`) shares the service.

- The reasoning split: `reasoning_content` (and `reasoning`) and `content` are transformers'
  greedy text split by the parser, streamed or not, and as the gRPC API's `reasoning_text`.
- Forced calls (`tool_choice` required and named) in each format: the model writes the format
  under its constraint, the gateway reads the same calls from it as the gRPC API's text gives,
  streamed or not, each valid for its schema.
- Free calls (`tool_choice` auto): the model made to write a call in the format (a choice
  constraint of one text) is read into `tool_calls`, with the text before it as content.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import jsonschema
import openai
import pytest

from pagoda import model_files
from pagoda.client import Client
from pagoda.reasoning import get_reasoning_parser
from pagoda.tool_parsers import TOOL_PARSERS, get_tool_parser
from tests.client.services import EXECUTOR_ARGS, target
from tests.gateway.gateway import Gateway
from tests.model_families import build_family, load_reference
from tests.references import hf_greedy
from tests.service.harness import Service

pytestmark = pytest.mark.timeout(600)

THINKING_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions. <tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

MESSAGES = [{"role": "user", "content": "What will the weather be in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# bounded arguments, so that a random model's constrained calls end within max_tokens
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
MODEL = ""  # the served model's name (set by the `gateways` fixture)
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# a call in each format, as a model would write it freely
FREE = {
    "hermes": 'Let me look. <tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
    "llama3_json": '{"name": "get_time", "parameters": {"zone": "CET"}}',
    "mistral": 'Let me look. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]',
    "qwen3_coder": "Let me look. <tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>",
    "pythonic": '[get_time(zone="CET")]',
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = build_family("llama", tmp_path_factory.mktemp("thinking-llama"), model_files.resolve_model(None, weights=False))
    (out / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def no_blanks(model_dir) -> dict[int, float]:
    """A logit bias against the tokens of only whitespace: JSON (and Qwen3-Coder's XML) let a
    constrained random model write blanks without end; with it the calls end (a format's own
    newlines stay allowed: the grammar masks every other token there)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    bias = {i: -100.0 for i in range(len(tokenizer)) if (s := tokenizer.decode([i])) and not s.strip()}
    [newline] = tokenizer.encode("\n", add_special_tokens=False)
    bias[newline] = -50.0  # where only blanks may come (before a format's "\n</function>"), one newline
    return bias


@pytest.fixture(scope="module")
def svc(model_dir):
    with Service(model=str(model_dir), executor_args=EXECUTOR_ARGS) as service:
        yield service


@pytest.fixture(scope="module")
def grpc_client(svc):
    with Client(target(svc), timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def gateways(svc, grpc_client):
    """The default gateway (its parsers the scheduler's) as "auto", and one per other tool-call format."""
    names = ["auto", *(n for n in TOOL_PARSERS if n != "hermes")]
    gws = {n: Gateway(target(svc), [] if n == "auto" else ["--tool-call-parser", n]) for n in names}
    with ExitStack() as stack, ThreadPoolExecutor(len(gws)) as pool:
        for gw in pool.map(stack.enter_context, gws.values()):
            pass
        global MODEL
        MODEL = grpc_client.model_info().name
        yield {n: openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=120)
               for n, gw in gws.items()}


def oai_for(gateways, parser: str) -> openai.OpenAI:
    return gateways["auto" if parser == "hermes" else parser]


def streamed(oai, **kwargs) -> tuple[str, str, dict[int, dict], str]:
    """A streamed chat's reasoning, content, tool calls joined from their deltas, and finish reason."""
    reasoning, content, calls, finish = "", "", {}, None
    for event in oai.chat.completions.create(stream=True, **kwargs):
        choice = event.choices[0]
        extra = choice.delta.model_extra or {}
        assert extra.get("reasoning_content") == extra.get("reasoning")
        reasoning += extra.get("reasoning_content") or ""
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


def test_the_scheduler_chose_its_parsers_from_the_template(grpc_client):
    info = grpc_client.model_info()
    assert (info.reasoning_parser, info.tool_call_parser) == ("qwen3", "hermes")


@pytest.mark.parametrize("thinking", [True, False])
def test_reasoning_content_is_the_references_text_split_streamed_or_not(gateways, grpc_client, model_dir, thinking):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    kwargs = {} if thinking else {"enable_thinking": False}
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    assert prompt.endswith("<think>\n") == thinking
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    text = tokenizer.decode(hf_greedy(load_reference(model_dir), ids, 24), skip_special_tokens=True)
    want_reasoning, want_content = get_reasoning_parser("qwen3").split(prompt, text)
    assert (want_reasoning, want_content) == ((text, "") if thinking else ("", text))  # a random model never ends it

    oai = gateways["auto"]
    request = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                   extra_body={"chat_template_kwargs": kwargs} if kwargs else None)
    reply = oai.chat.completions.create(**request)
    message = reply.choices[0].message.model_dump()
    assert message.get("reasoning_content") == message.get("reasoning") == (want_reasoning or None)
    assert (message["content"] or "") == want_content
    assert streamed(oai, **request)[:2] == (want_reasoning, want_content)
    got = grpc_client.chat(MESSAGES, max_tokens=24, temperature=0, chat_template_kwargs=kwargs or None).collect()
    assert (got.outputs[0].reasoning_text, got.text) == (want_reasoning, want_content)
    raw = grpc_client.chat(MESSAGES, max_tokens=24, temperature=0, chat_template_kwargs=kwargs or None,
                           reasoning_parser="none").collect()
    assert (raw.outputs[0].reasoning_text, raw.text) == ("", text)
    if thinking:  # a constraint starts once the reasoning ends: the reasoning is written as without it
        constrained = oai.chat.completions.create(**{**request, "extra_body": {"structured_outputs": {"choice": ["yes"]}}})
        assert constrained.choices[0].message.model_dump().get("reasoning_content") == want_reasoning
        assert (constrained.choices[0].message.content, constrained.choices[0].finish_reason) == (None, "length")
    hidden = oai.chat.completions.create(**{**request, "extra_body": {**(request["extra_body"] or {}),
                                                                     "include_reasoning": False}})
    assert "reasoning_content" not in hidden.choices[0].message.model_dump()


@pytest.mark.parametrize("parser", list(TOOL_PARSERS))
def test_forced_calls_in_each_format_streamed_or_not(gateways, grpc_client, no_blanks, parser):
    oai, tool_parser = oai_for(gateways, parser), get_tool_parser(parser)
    for choice, constraint in [
        ("required", tool_parser.constraint(TOOLS, parallel=False)),  # a random model would call on and on
        ({"type": "function", "function": {"name": "get_weather"}}, tool_parser.constraint(TOOLS, function="get_weather")),
    ]:
        want = grpc_client.chat(MESSAGES, max_tokens=96, temperature=0, tools=TOOLS, logit_bias=no_blanks,
                                chat_template_kwargs=NO_THINKING["chat_template_kwargs"],
                                skip_special_tokens=False if parser == "mistral" else None, **constraint).collect()
        assert want.outputs[0].finish_reason.value == "eos", want.text  # the calls are whole
        content, calls = tool_parser.parse(want.text, TOOLS)
        assert calls and content is None, want.text
        request = dict(model=MODEL, messages=MESSAGES, max_tokens=96, temperature=0, tools=TOOLS, tool_choice=choice,
                       parallel_tool_calls=False, logit_bias={str(k): v for k, v in no_blanks.items()},
                       extra_body=NO_THINKING)
        reply = oai.chat.completions.create(**request)
        message = reply.choices[0].message
        assert (reply.choices[0].finish_reason, message.content) == ("tool_calls", None)
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == calls and len(calls) == 1
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if choice != "required":
            assert [c.function.name for c in message.tool_calls] == ["get_weather"]
        _, content, streamed_calls, finish = streamed(oai, **request)
        assert (content, finish) == ("", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in streamed_calls.values()] == calls


@pytest.mark.parametrize("parser", list(TOOL_PARSERS))
def test_a_free_call_in_each_format_is_read_streamed_or_not(gateways, parser):
    oai = oai_for(gateways, parser)
    request = dict(model=MODEL, messages=MESSAGES, max_tokens=96, temperature=0, tools=TOOLS,
                   extra_body={**NO_THINKING, "structured_outputs": {"choice": [FREE[parser]]}})
    reply = oai.chat.completions.create(**request)
    message = reply.choices[0].message
    before = "Let me look. " if FREE[parser].startswith("Let me look. ") else None
    assert message.content == before and reply.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_time", '{"zone": "CET"}')]
    _, content, calls, finish = streamed(oai, **request)
    assert (content or None, finish) == (before, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_time", '{"zone": "CET"}')]
    plain = oai.chat.completions.create(**{**request, "extra_body": {**NO_THINKING, "structured_outputs": {
        "choice": ["No call: it is sunny."]}}})
    assert (plain.choices[0].message.content, plain.choices[0].message.tool_calls) == ("No call: it is sunny.", None)


# ---- each format with its family's chat template (tests/data/chat_templates/) -------------
# The service's model has the thinking template above; a family's template renders the prompt
# here as the scheduler would (tests/chat_templates.py, the same tokenizer), and the gateway's own
# pieces build the constraint (`structured`) and read the answer (`read_output`).


@pytest.mark.parametrize("parser", list(TOOL_PARSERS))
def test_forced_and_free_calls_with_the_familys_own_template(grpc_client, model_dir, no_blanks, parser):
    from transformers import AutoTokenizer

    from gateway_svc.schemas import ChatCompletionRequest
    from gateway_svc.tools import read_output, structured
    from tests.chat_templates import family_template, render, with_template

    tokenizer = with_template(AutoTokenizer.from_pretrained(model_dir), family_template(parser))
    ids = render(tokenizer, MESSAGES, TOOLS)
    tool_parser = get_tool_parser(parser)
    special = {"skip_special_tokens": False} if parser == "mistral" else {}
    for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
        req = ChatCompletionRequest(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                    parallel_tool_calls=False)
        s = structured(req, tool_parser)
        out = grpc_client.generate(ids, max_tokens=96, temperature=0, logit_bias=no_blanks, **special,
                                   **s.params).collect()
        assert out.outputs[0].finish_reason.value == "eos", out.text  # the call is whole
        content, calls = read_output(s, out.text, parallel=False)
        assert content is None and len(calls) == 1, out.text
        name, arguments = calls[0]["function"]["name"], calls[0]["function"]["arguments"]
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert choice == "required" or name == "get_weather"
    free = structured(ChatCompletionRequest(model=MODEL, messages=MESSAGES, tools=TOOLS), tool_parser)
    out = grpc_client.generate(ids, max_tokens=96, temperature=0, choice=[FREE[parser]], **special).collect()
    content, calls = read_output(free, out.text)
    assert content == ("Let me look. " if FREE[parser].startswith("Let me look. ") else None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("get_time", '{"zone": "CET"}')]


# ---- the same split and constraint rule over vllm.grpc.engine.VllmEngine (SMG's protocol) ---


def test_vllm_engine_declares_the_reasoning_parser_and_starts_a_constraint_after_the_thought(svc, model_dir):
    """GetServerInfo names the scheduler's parser and "after_reasoning"; a constrained Generate on a
    prompt that opened the thought writes the thought unconstrained (transformers' greedy tokens:
    a random model never closes it), and with `grammar_from_first_token` the grammar runs at once."""
    import uuid

    from smg_grpc_proto import vllm_engine_pb2 as vpb
    from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
    from transformers import AutoTokenizer

    stub = vpb_grpc.VllmEngineStub(svc.channel)
    info = stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10)
    assert (info.engine_reasoning_parser, info.constrained_decoding_start) == ("qwen3", "after_reasoning")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    thought = hf_greedy(load_reference(model_dir), ids, 24)

    def generate(**sampling) -> vpb.GenerateComplete:
        params = vpb.SamplingParams(temperature=0.0, max_tokens=24, choice=vpb.ChoiceConstraint(choices=["yes"]), **sampling)
        request = vpb.GenerateRequest(request_id=uuid.uuid4().hex, tokenized=vpb.TokenizedInput(input_ids=ids),
                                      sampling_params=params, stream=False)
        (reply,) = stub.Generate(request, timeout=120)
        return reply.complete

    held = generate()
    assert (list(held.output_ids), held.finish_reason) == (thought, "length")
    led = generate(grammar_from_first_token=True)
    assert tokenizer.decode(led.output_ids, skip_special_tokens=True) == "yes" and led.finish_reason == "stop"
