"""The gateway with the official `openai` package as its client, against the real service.

Greedy answers through the gateway equal the gRPC API's (via pagoda.client), streamed or not;
structured output and tool calls too (the same constraint sent over gRPC gives the same text).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx2 as httpx
import jsonschema
import openai
import pytest

from scheduler_svc.chat import hermes
from pagoda.client import Client
from pagoda.tool_parsers import get_tool_parser
from tests.client.keyed_server import KEY, insecure_keyed_server
from tests.client.services import EXECUTOR_ARGS, target
from tests.gateway.gateway import Gateway
from tests.service.harness import ROOT, Service
from tests.structured_reference import CHOICES, DATE_REGEX, LABEL_SCHEMA, WEATHER_TOOL

pytestmark = pytest.mark.timeout(600)

MESSAGES = [{"role": "user", "content": "Name three colors of the rainbow."}]


@pytest.fixture(scope="module")
def svc():
    with Service(executor_args=EXECUTOR_ARGS) as service:
        yield service


@pytest.fixture(scope="module")
def grpc_client(svc):
    with Client(target(svc), timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def gateway(svc):
    with Gateway(target(svc)) as gw:
        yield gw


@pytest.fixture(scope="module")
def oai(gateway):
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(grpc_client):
    return grpc_client.model_info().name


def test_models_lists_the_name_get_model_info_reports(oai, model_name):
    assert [m.id for m in oai.models.list().data] == [model_name]


def test_chat_completion_equals_the_grpc_api_streamed_or_not(oai, grpc_client, model_name):
    expected = grpc_client.chat(MESSAGES, max_tokens=24, temperature=0.0)
    want = expected.collect()
    reply = oai.chat.completions.create(model=model_name, messages=MESSAGES, max_completion_tokens=24, temperature=0)
    assert reply.choices[0].message.content == want.text
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == ("length" if want.outputs[0].finish_reason.value == "length" else "stop")
    assert reply.usage.prompt_tokens == expected.usage.prompt_tokens
    assert reply.usage.completion_tokens == expected.usage.completion_tokens

    events = list(oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=24, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == want.text
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == reply.choices[0].finish_reason
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == expected.usage.completion_tokens


def test_completions_with_seed_n_and_stop_equal_the_grpc_api(oai, grpc_client, model_name):
    prompt = "The capital of Italy is"
    want = grpc_client.generate(prompt, max_tokens=16, temperature=0.8, seed=11, n=2).collect()
    reply = oai.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0.8, seed=11, n=2)
    assert [c.text for c in reply.choices] == [o.text for o in want.outputs]
    streamed = oai.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0.8, seed=11, n=2,
                                      stream=True)
    texts = ["", ""]
    for event in streamed:
        for choice in event.choices:
            texts[choice.index] += choice.text
    assert texts == [o.text for o in want.outputs]

    full = grpc_client.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True).collect().text
    stop = full.strip().split()[1]  # the second word of the greedy answer
    stopped = oai.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full[: full.index(stop)]


def test_two_prompts_and_token_id_prompts(oai, grpc_client, model_name):
    ids = list(grpc_client.tokenize("Water boils at").token_ids)
    reply = oai.completions.create(model=model_name, prompt=["Water boils at", "Ice melts at"], max_tokens=8,
                                   temperature=0)
    assert [c.index for c in reply.choices] == [0, 1]
    by_ids = oai.completions.create(model=model_name, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == reply.choices[0].text
    assert reply.usage.prompt_tokens == len(ids) + len(grpc_client.tokenize("Ice melts at").token_ids)


def test_logprobs_chat_and_completions(oai, model_name):
    reply = oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=6, temperature=0,
                                        logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5
    comp = oai.completions.create(model=model_name, prompt="One, two,", max_tokens=5, temperature=0, logprobs=3)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset[0] == 0


def test_penalties_logit_bias_and_user_reach_the_sampler(oai, grpc_client, model_name):
    first = grpc_client.chat(MESSAGES, max_tokens=1, temperature=0).collect().outputs[0].token_ids[0]
    biased = grpc_client.chat(MESSAGES, max_tokens=4, temperature=0, presence_penalty=0.5, frequency_penalty=0.5,
                              logit_bias={first: -100}).collect()
    assert biased.outputs[0].token_ids[0] != first
    reply = oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4, temperature=0,
                                        presence_penalty=0.5, frequency_penalty=0.5, user="tester",
                                        logit_bias={str(first): -100})
    assert reply.choices[0].message.content == biased.text


def test_errors_have_openai_shape_and_status(oai, gateway, model_name):
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=model_name, messages=MESSAGES, top_p=1.5)
    assert err.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as err:  # refused by the scheduler: named as OpenAI names it
        oai.completions.create(model=model_name, prompt="hi", logit_bias={"99999999": 1})
    assert err.value.body["param"] == "logit_bias" and err.value.body["message"].startswith("logit_bias")
    with pytest.raises(openai.BadRequestError) as err:  # the scheduler's check of the prompt's length
        oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=10 ** 6)
    assert err.value.body["param"] == "max_tokens", err.value.body
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": model_name, "messages": MESSAGES,
                                                               "stream": True, "top_k": -3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"


def test_a_caller_that_disconnects_aborts_its_request(svc, gateway, model_name):
    body = {"model": model_name, "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = 0
        for line in r.iter_lines():
            lines += bool(line)
            if lines == 3:
                break
    assert svc.wait_all_blocks_free(timeout=15).num_running == 0

    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=2.0)
    info = svc.wait_all_blocks_free(timeout=15)
    assert info.num_running == 0 and time.monotonic() - start < 30  # 2000 tokens take minutes here


def test_health_and_metrics(gateway):
    assert httpx.get(f"{gateway.url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{gateway.url}/metrics").text
    assert 'pagoda_gateway_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert "pagoda_gateway_requests_in_flight" in text


def test_the_bearer_key_is_passed_through():
    with insecure_keyed_server() as keyed, Gateway(keyed) as gw:
        good = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0)
        assert good.chat.completions.create(model="keyed", messages=MESSAGES).choices[0].message.content == "ok!"
        bad = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="keyed", messages=MESSAGES)


# -- structured output and tool calls --------------------------------------------------

LABEL_MESSAGES = [{"role": "user", "content": "Is a kitten a cat or a dog? Answer as JSON with a score."}]
WEATHER_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_PARAMETERS = WEATHER_TOOL["function"]["parameters"]
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def streamed_chat(oai, **kwargs) -> tuple[str, dict[int, dict], str]:
    """A streamed chat's content, tool calls reassembled from their deltas, and finish reason."""
    content, calls, finish = "", {}, None
    for event in oai.chat.completions.create(stream=True, **kwargs):
        choice = event.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
            assert delta.id in (None, call["id"])
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_response_format_json_schema_equals_the_grpc_constrained_output(oai, grpc_client, model_name):
    want = grpc_client.chat(LABEL_MESSAGES, max_tokens=40, temperature=0, json_schema=LABEL_SCHEMA).collect()
    assert want.outputs[0].finish_reason.value == "eos"  # finished: the schema's object is whole
    response_format = {"type": "json_schema", "json_schema": {"name": "label", "schema": LABEL_SCHEMA, "strict": True}}
    reply = oai.chat.completions.create(model=model_name, messages=LABEL_MESSAGES, max_tokens=40, temperature=0,
                                        response_format=response_format)
    assert reply.choices[0].message.content == want.text
    jsonschema.validate(json.loads(reply.choices[0].message.content), LABEL_SCHEMA)
    assert reply.choices[0].finish_reason == "stop"
    content, calls, finish = streamed_chat(oai, model=model_name, messages=LABEL_MESSAGES, max_tokens=40,
                                           temperature=0, response_format=response_format)
    assert (content, calls, finish) == (want.text, {}, "stop")


def test_json_object_and_structured_outputs_regex_and_choice(oai, grpc_client, model_name):
    prompt = [{"role": "user", "content": "Describe a cat as a JSON object."}]
    want = grpc_client.chat(prompt, max_tokens=48, temperature=0, json_object=True).collect().text
    reply = oai.chat.completions.create(model=model_name, messages=prompt, max_tokens=48, temperature=0,
                                        response_format={"type": "json_object"})
    assert reply.choices[0].message.content == want
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(want), dict)

    date = [{"role": "user", "content": "When did the Berlin wall fall? Answer with the date."}]
    reply = oai.chat.completions.create(model=model_name, messages=date, max_tokens=16, temperature=0,
                                        extra_body={"structured_outputs": {"regex": DATE_REGEX}})
    assert re.fullmatch(DATE_REGEX, reply.choices[0].message.content), reply.choices[0].message.content
    assert reply.choices[0].message.content == grpc_client.chat(date, max_tokens=16, temperature=0,
                                                                regex=DATE_REGEX).collect().text
    completion = oai.completions.create(model=model_name, prompt="The Berlin wall fell on", max_tokens=16,
                                        temperature=0, extra_body={"structured_outputs": {"regex": DATE_REGEX}})
    assert re.fullmatch(DATE_REGEX, completion.choices[0].text), completion.choices[0].text

    sentiment = [{"role": "user", "content": "What is the sentiment of 'I love this film'?"}]
    for extra in ({"structured_outputs": {"choice": list(CHOICES)}}, {"guided_choice": list(CHOICES)}):
        reply = oai.chat.completions.create(model=model_name, messages=sentiment, max_tokens=8, temperature=0,
                                            extra_body=extra)
        assert reply.choices[0].message.content in CHOICES


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_calls_the_tools_streamed_or_not(oai, grpc_client, model_name, parallel):
    tools = [WEATHER_TOOL, TIME_TOOL]
    kwargs = dict(model=model_name, messages=WEATHER_MESSAGES, max_tokens=64, temperature=0, tools=tools,
                  tool_choice="required", parallel_tool_calls=parallel)
    reply = oai.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    # parallel: the model may call on until max_tokens; the calls it closed are read
    assert choice.finish_reason in ("tool_calls", "length" if parallel else "tool_calls")
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    content, streamed, finish = streamed_chat(oai, **kwargs)
    assert (content, finish) == ("", choice.finish_reason)
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == \
           [(c.function.name, c.function.arguments) for c in calls]


def test_a_named_function_is_called_in_the_hermes_form_as_the_grpc_api_generates_it(oai, grpc_client, model_name):
    tools = [TIME_TOOL, WEATHER_TOOL]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    hermes_form = get_tool_parser("hermes")  # SmolLM2's template says nothing: the scheduler reports hermes
    want = grpc_client.chat(WEATHER_MESSAGES, max_tokens=48, temperature=0, tools=tools,
                            **hermes_form.constraint(tools, function="get_weather")).collect()
    assert want.outputs[0].finish_reason.value == "eos" and want.text.startswith('<tool_call>\n{"name": "get_weather"')
    [(_, arguments)] = hermes_form.parse(want.text, tools)[1]
    kwargs = dict(model=model_name, messages=WEATHER_MESSAGES, max_tokens=48, temperature=0, tools=tools,
                  tool_choice=choice)
    reply = oai.chat.completions.create(**kwargs)
    [call] = reply.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", arguments)
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    assert reply.choices[0].finish_reason == "tool_calls"
    content, streamed, finish = streamed_chat(oai, **kwargs)
    assert (content, finish) == ("", "tool_calls")
    assert list(streamed.values()) == [{"id": streamed[0]["id"], "name": "get_weather", "arguments": arguments}]


def test_tool_choice_auto_describes_the_tools_and_reads_the_answer(oai, grpc_client, model_name):
    from gateway_svc.tools import parse_hermes

    want = grpc_client.chat(WEATHER_MESSAGES, max_tokens=48, temperature=0, tools=[WEATHER_TOOL]).collect().text
    # SmolLM2's template does not read tools: the scheduler writes them in the Hermes form
    assert want == grpc_client.chat(hermes(WEATHER_MESSAGES, [WEATHER_TOOL]), max_tokens=48, temperature=0).collect().text
    assert want != grpc_client.chat(WEATHER_MESSAGES, max_tokens=48, temperature=0).collect().text
    content, calls = parse_hermes(want)
    reply = oai.chat.completions.create(model=model_name, messages=WEATHER_MESSAGES, max_tokens=48, temperature=0,
                                        tools=[WEATHER_TOOL])
    message = reply.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == calls
    assert message.content == ((content or None) if calls else want)
    history = [*WEATHER_MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    reply = oai.chat.completions.create(model=model_name, messages=history, max_tokens=8, temperature=0,
                                        tools=[WEATHER_TOOL])
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_schemas_and_formats_are_a_400_naming_the_openai_field(oai, model_name):
    bad = {"type": "foo"}
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}), "response_format"),
        (dict(tools=[WEATHER_TOOL, {"type": "function", "function": {"name": "f", "parameters": bad}}],
              tool_choice={"type": "function", "function": {"name": "f"}}), "tools[1].function.parameters"),
        (dict(extra_body={"structured_outputs": {"regex": "(a"}}), "structured_outputs.regex"),
        (dict(response_format={"type": "xml"}), "response_format"),
        (dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"choice": ["a"]}}),
         "structured_outputs.choice"),
    ]
    for (kwargs, param), stream in zip(cases, (False, True, False, True, False)):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4, stream=stream, **kwargs)
        assert err.value.body["param"] == param, err.value.body
        assert err.value.body["message"].startswith(param), err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model_name, prompt="hi", max_tokens=4,
                               extra_body={"response_format": {"type": "json_schema",
                                                               "json_schema": {"name": "x", "schema": bad}}})
    assert err.value.body["param"] == "response_format", err.value.body


def test_the_readme_structured_output_example_runs_as_written(gateway, model_name):
    readme = (ROOT / "README.md").read_text()
    example = readme.split("Structured output and a tool call, with the `openai` package:\n\n```python\n", 1)[1]
    example = example.split("```", 1)[0].replace("http://127.0.0.1:8000", gateway.url)
    done = subprocess.run([sys.executable, "-c", example.replace("SmolLM2-135M-Instruct", model_name)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    *arguments, answer = done.stdout.splitlines()  # the arguments' JSON may span lines
    assert json.loads("\n".join(arguments))["city"], done.stdout
    assert answer in ("cat", "dog"), done.stdout
