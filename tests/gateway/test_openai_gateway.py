"""The gateway with the official `openai` package as its client, against the real service.

Greedy answers through the gateway equal the gRPC API's (via pagoda.client), streamed or not.
"""

from __future__ import annotations

import time

import httpx2 as httpx
import openai
import pytest

from pagoda.client import Client
from tests.client.keyed_server import KEY, insecure_keyed_server
from tests.client.services import EXECUTOR_ARGS, target
from tests.gateway.gateway import Gateway
from tests.service.harness import Service

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
