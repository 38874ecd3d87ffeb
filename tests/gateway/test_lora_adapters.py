"""LoRA adapters through the gateway (issue 38, point 6), with the official `openai` package as the
client: a request's `model` reaches the scheduler as `GenerateRequest.model` (none, or the base's
name: the base), an adapter it has not loaded is a 404 naming `model`; `/v1/models` lists the base
and each loaded adapter with the base as `parent` (vLLM's shape); vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` reach the scheduler's RPCs behind the caller's key, its refusals keeping
their status and message.

The scheduler is a stand-in that records what it is sent and keeps its own set of loaded adapters;
the gateway is its own process.
"""

from __future__ import annotations

import httpx2 as httpx
import openai
import pytest

from tests.client.keyed_server import KEY, insecure_keyed_server
from tests.client.lora_server import BASE, REFUSALS, LoraServicer
from tests.gateway.gateway import Gateway

pytestmark = pytest.mark.timeout(120)

AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "hi"}]

@pytest.fixture(scope="module")
def stack():
    servicer = LoraServicer()
    with insecure_keyed_server(servicer) as target, Gateway(target) as gateway:
        yield gateway, servicer


@pytest.fixture
def servicer(stack):
    servicer = stack[1]
    servicer.adapters[:] = ["sql", "poem"]
    return servicer


@pytest.fixture
def oai(stack):
    return openai.OpenAI(base_url=f"{stack[0].url}/v1", api_key=KEY, max_retries=0, timeout=30)


def post(stack, route: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{stack[0].url}/v1/{route}", json=body, headers=headers, timeout=30)


# -- a request's model -----------------------------------------------------------------


def test_the_model_named_reaches_the_scheduler_and_is_echoed(oai, servicer):
    reply = oai.chat.completions.create(model="sql", messages=MESSAGES, max_tokens=2)
    assert servicer.requests[-1].model == "sql" and reply.model == "sql"
    assert reply.choices[0].message.content == "ok!"
    reply = oai.completions.create(model="poem", prompt=["a", "b"], max_tokens=2)
    assert [r.model for r in servicer.requests[-2:]] == ["poem", "poem"] and reply.model == "poem"
    events = list(oai.chat.completions.create(model="poem", messages=MESSAGES, max_tokens=2, stream=True))
    assert servicer.requests[-1].model == "poem" and {e.model for e in events} == {"poem"}


def test_the_base_name_or_no_model_is_the_base(stack, oai, servicer):
    reply = oai.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=2)
    assert servicer.requests[-1].model == "" and reply.model == BASE
    reply = post(stack, "completions", {"prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    assert servicer.requests[-1].model == "" and reply.json()["model"] == BASE


@pytest.mark.parametrize("stream", [False, True])
def test_an_adapter_not_loaded_is_404_naming_model_before_any_generate(oai, servicer, stream):
    before = len(servicer.requests)
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2, stream=stream)
    error = err.value.body
    assert error["param"] == "model" and error["code"] == "model_not_found", error
    assert error["message"].startswith(f"The model `nope` does not exist: neither `{BASE}` nor"), error
    with pytest.raises(openai.NotFoundError) as err:
        oai.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
    assert len(servicer.requests) == before  # a scheduler without the adapter never answers with the base


def test_an_adapter_loaded_since_the_gateway_last_looked_is_found(oai, servicer):
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="late", messages=MESSAGES, max_tokens=2)
    servicer.adapters.append("late")  # loaded by another caller, straight at the scheduler
    assert oai.chat.completions.create(model="late", messages=MESSAGES, max_tokens=2).model == "late"
    assert servicer.requests[-1].model == "late"


@pytest.mark.parametrize("stream", [False, True])
def test_the_schedulers_not_found_naming_model_is_404_naming_model(oai, servicer, stream):
    """An adapter unloaded since the gateway last looked: the scheduler's NOT_FOUND decides."""
    servicer.adapters.append("gone")
    oai.chat.completions.create(model="gone", messages=MESSAGES, max_tokens=2)
    servicer.adapters.remove("gone")  # unloaded straight at the scheduler
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="gone", messages=MESSAGES, max_tokens=2, stream=stream)
    assert servicer.requests[-1].model == "gone"
    assert err.value.body == {"message": "The model `gone` does not exist: no LoRA adapter named 'gone' is loaded",
                              "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


# -- /v1/models --------------------------------------------------------------------------


def test_models_lists_the_base_then_each_adapter_with_the_base_as_parent(oai, servicer):
    cards = [m.to_dict() for m in oai.models.list().data]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        (BASE, None, BASE), ("sql", BASE, "sql"), ("poem", BASE, "poem")]
    assert all(c["object"] == "model" and c["owned_by"] == "pagoda" and c["max_model_len"] == 512 for c in cards)
    servicer.adapters.clear()
    assert [m.id for m in oai.models.list().data] == [BASE]  # asked again, not remembered


# -- /v1/load_lora_adapter and /v1/unload_lora_adapter -----------------------------------


def test_load_then_unload_changes_what_models_lists(stack, oai, servicer):
    reply = post(stack, "load_lora_adapter", {"lora_name": "chat", "lora_path": "/adapters/chat"})
    assert reply.status_code == 200 and reply.text == "Success: LoRA adapter 'chat' added successfully."
    assert (servicer.loads[-1].lora_name, servicer.loads[-1].lora_path) == ("chat", "/adapters/chat")
    assert [m.id for m in oai.models.list().data] == [BASE, "sql", "poem", "chat"]
    assert oai.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=2).model == "chat"

    reply = post(stack, "unload_lora_adapter", {"lora_name": "sql"})
    assert reply.status_code == 200 and reply.text == "Success: LoRA adapter 'sql' removed successfully."
    assert servicer.unloads[-1].lora_name == "sql"
    assert [m.id for m in oai.models.list().data] == [BASE, "poem", "chat"]
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="sql", messages=MESSAGES, max_tokens=2)


@pytest.mark.parametrize("path, status, kind, param", [
    ("/adapters/rank-128", 400, "invalid_request_error", "lora_path"),
    ("/adapters/missing", 404, "not_found_error", "lora_path"),
    ("/adapters/disabled", 400, "invalid_request_error", "lora_name"),
    ("/adapters/taken", 409, "conflict_error", "lora_name"),
])
def test_a_refused_load_keeps_the_schedulers_status_and_message(stack, servicer, path, status, kind, param):
    reply = post(stack, "load_lora_adapter", {"lora_name": "bad", "lora_path": path})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error == {"message": REFUSALS[path][1], "type": kind, "param": param,
                     "code": REFUSALS[path][0].name.lower()}
    assert servicer.loads[-1].lora_path == path and "bad" not in servicer.adapters


def test_unloading_an_adapter_not_loaded_is_404_naming_lora_name(stack, servicer):
    reply = post(stack, "unload_lora_adapter", {"lora_name": "nope"})
    assert reply.status_code == 404, reply.text
    assert reply.json()["error"]["param"] == "lora_name" and "'nope'" in reply.json()["error"]["message"]


@pytest.mark.parametrize("route, body, param", [
    ("load_lora_adapter", {"lora_name": "x"}, "lora_path"),
    ("load_lora_adapter", {"lora_name": "", "lora_path": "/adapters/x"}, "lora_name"),
    ("load_lora_adapter", {"lora_name": "x", "lora_path": "/adapters/x", "base_model_name": "y"}, "base_model_name"),
    ("unload_lora_adapter", {}, "lora_name"),
])
def test_a_malformed_body_is_400_naming_the_field_before_any_grpc_call(stack, servicer, route, body, param):
    before = (len(servicer.loads), len(servicer.unloads))
    reply = post(stack, route, body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    assert (len(servicer.loads), len(servicer.unloads)) == before


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}])
def test_the_adapter_routes_need_the_key(stack, servicer, headers):
    before = (len(servicer.loads), len(servicer.unloads))
    load = post(stack, "load_lora_adapter", {"lora_name": "x", "lora_path": "/adapters/x"}, headers=headers)
    unload = post(stack, "unload_lora_adapter", {"lora_name": "sql"}, headers=headers)
    assert load.status_code == unload.status_code == 401
    assert load.json()["error"]["type"] == "authentication_error"
    assert (len(servicer.loads), len(servicer.unloads)) == before and "x" not in servicer.adapters
    assert httpx.get(f"{stack[0].url}/v1/models", headers=headers, timeout=30).status_code == 401
