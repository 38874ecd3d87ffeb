"""LoRA adapters from the Python client and the `pagoda` CLI (issue 38, point 6): `model=` (a keyword
or in `GenerateParams`) is `GenerateRequest.model`; `load_lora_adapter` / `unload_lora_adapter` reach
the scheduler's RPCs with the client's key, its refusals raised typed; `model_info().lora_adapters`.

The scheduler is a stand-in (`tests.client.lora_server`) that records what it is sent.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from pagoda.client import (
    AlreadyExists,
    AsyncClient,
    Client,
    FailedPrecondition,
    GenerateParams,
    InvalidArgument,
    NotFound,
    Unauthenticated,
)
from pagoda.v1 import generation_pb2 as pb
from tests.client.keyed_server import KEY, insecure_keyed_server
from tests.client.lora_server import BASE, REFUSALS, LoraServicer
from tests.service.harness import ROOT

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "hi"}]
TYPED = {"/adapters/rank-128": InvalidArgument, "/adapters/missing": NotFound,
         "/adapters/disabled": FailedPrecondition, "/adapters/taken": AlreadyExists}


@pytest.fixture(scope="module")
def server():
    servicer = LoraServicer()
    with insecure_keyed_server(servicer) as target:
        yield target, servicer


@pytest.fixture
def servicer(server):
    servicer = server[1]
    servicer.adapters[:] = ["sql", "poem"]
    return servicer


@pytest.fixture
def client(server):
    with Client(server[0], api_key=KEY, timeout=30) as c:
        yield c


def test_model_is_the_requests_model_as_a_keyword_or_in_params(client, servicer):
    assert client.generate("hi", model="sql", max_tokens=2).collect().text == "ok!"
    assert servicer.requests[-1].model == "sql"
    client.chat(MESSAGES, GenerateParams(model="poem", max_tokens=2)).collect()
    assert servicer.requests[-1].model == "poem" and servicer.requests[-1].WhichOneof("prompt") == "chat"
    client.chat(MESSAGES, GenerateParams(model="poem"), model=None).collect()  # an override clears it
    client.generate([1, 2]).collect()
    assert [r.model for r in servicer.requests[-2:]] == ["", ""]
    assert GenerateParams(model="sql").fill(pb.GenerateRequest()).model == "sql"


def test_a_model_not_loaded_raises_not_found_naming_model(client, servicer):
    with pytest.raises(NotFound) as err:
        client.generate("hi", model="nope").collect()
    assert err.value.details.startswith("model: ") and "'nope'" in err.value.details


def test_load_unload_and_model_info(client, servicer):
    assert client.model_info().lora_adapters == ("sql", "poem")
    client.load_lora_adapter("chat", "/adapters/chat")
    assert (servicer.loads[-1].lora_name, servicer.loads[-1].lora_path) == ("chat", "/adapters/chat")
    client.unload_lora_adapter("sql")
    assert servicer.unloads[-1].lora_name == "sql"
    info = client.model_info()
    assert info.name == BASE and info.lora_adapters == ("poem", "chat")


@pytest.mark.parametrize("path", sorted(REFUSALS))
def test_a_refused_load_raises_the_typed_status_with_the_schedulers_message(client, servicer, path):
    with pytest.raises(TYPED[path]) as err:
        client.load_lora_adapter("bad", path)
    assert err.value.details == REFUSALS[path][1] and "bad" not in servicer.adapters


def test_the_adapter_calls_send_the_clients_key(server, servicer):
    with Client(server[0], api_key="wrong-key", timeout=30) as c:
        with pytest.raises(Unauthenticated):
            c.load_lora_adapter("x", "/adapters/x")
        with pytest.raises(Unauthenticated):
            c.unload_lora_adapter("sql")
        c.load_lora_adapter("x", "/adapters/x", api_key=KEY)  # this call's key
    assert "x" in servicer.adapters and "sql" in servicer.adapters


def test_the_async_client_does_the_same(server, servicer):
    async def run():
        async with AsyncClient(server[0], api_key=KEY, timeout=30) as c:
            await c.load_lora_adapter("chat", "/adapters/chat")
            assert (await c.model_info()).lora_adapters == ("sql", "poem", "chat")
            assert (await c.chat(MESSAGES, model="chat").collect()).text == "ok!"
            assert servicer.requests[-1].model == "chat"
            await c.unload_lora_adapter("chat")
            with pytest.raises(NotFound):
                await c.unload_lora_adapter("chat")
            with pytest.raises(NotFound):
                await c.generate("hi", model="chat").collect()

    asyncio.run(run())
    assert servicer.adapters == ["sql", "poem"]


# -- the CLI ---------------------------------------------------------------------------


def pagoda(server, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
    env["PAGODA_MODEL"] = "/models/base"  # the scheduler's --model: not read by the CLI's --model
    return subprocess.run([sys.executable, "-m", "pagoda", *args, "--target", server[0], "--api-key", KEY],
                          cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=60, env=env)


def test_cli_model_flag_selects_the_adapter(server, servicer):
    run = pagoda(server, "generate", "hi", "--model", "sql", "--max-tokens", "2")
    assert run.returncode == 0 and run.stdout == "ok!\n", run.stderr
    assert servicer.requests[-1].model == "sql"
    run = pagoda(server, "chat", "--model", "poem", stdin="hi\n/exit\n")
    assert run.returncode == 0 and run.stdout == "ok!\n", run.stderr
    assert servicer.requests[-1].model == "poem" and servicer.requests[-1].chat.messages[-1].content == "hi"
    run = pagoda(server, "generate", "hi")
    assert run.returncode == 0 and servicer.requests[-1].model == "", run.stderr
    run = pagoda(server, "generate", "hi", "--model", "nope")
    assert run.returncode == 1 and "NOT_FOUND: model: " in run.stderr, run.stderr


def test_cli_load_lora_unload_lora_and_info(server, servicer):
    run = pagoda(server, "load-lora", "chat", "/adapters/chat")
    assert run.returncode == 0 and "chat" in run.stdout, run.stderr
    assert (servicer.loads[-1].lora_name, servicer.loads[-1].lora_path) == ("chat", "/adapters/chat")
    run = pagoda(server, "info")
    assert run.returncode == 0, run.stderr
    assert "\nlora adapters      sql, poem, chat\n" in run.stdout, run.stdout
    run = pagoda(server, "unload-lora", "sql")
    assert run.returncode == 0 and servicer.unloads[-1].lora_name == "sql", run.stderr
    assert servicer.adapters == ["poem", "chat"]
    run = pagoda(server, "load-lora", "bad", "/adapters/rank-128")
    assert run.returncode == 1 and run.stderr == f"pagoda: INVALID_ARGUMENT: {REFUSALS['/adapters/rank-128'][1]}\n"
