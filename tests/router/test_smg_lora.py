"""How LoRA adapters are reached through SMG (issue 38, point 6; docs/router.md, "LoRA adapters behind
SMG"). VllmEngine's GenerateRequest has no adapter field, so SMG's gRPC path reaches only the base;
what does reach adapters is SMG in front of gateway_svc as an OpenAI-compatible HTTP worker
(`--backend openai`), which passes the body on as it came, `model` included. These tests pin down
SMG 1.13's behaviour there, and the trap: `--model-alias ADAPTER=BASE` rewrites `model` to the
base's name, so the base would answer under the adapter's name.

The scheduler is a stand-in (`tests.client.lora_server`) recording what it is sent; gateway_svc and
SMG are their own processes.
"""

from __future__ import annotations

import contextlib
from concurrent import futures

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bench.smg_router import SmgRouter
from pagoda.v1 import generation_pb2_grpc as pb_grpc
from tests.client.keyed_server import KEY
from tests.client.lora_server import BASE, LoraServicer
from tests.gateway.gateway import Gateway
from tests.service.harness import free_port

pytestmark = pytest.mark.timeout(300)

MESSAGES = [{"role": "user", "content": "hi"}]


class HttpSmg(SmgRouter):
    """SMG with HTTP workers of `backend`: ready once every worker is healthy (no tokenizer to wait for)."""

    def __init__(self, worker_urls: list[str], backend: str, extra_args=()):
        super().__init__(worker_urls, extra_args)
        self.args[self.args.index("--backend") + 1] = backend

    def ready(self) -> bool:
        healthy = [w for w in self.workers() if w.get("is_healthy") and w.get("status") == "ready"]
        return len(healthy) >= len(self.worker_urls)


@contextlib.contextmanager
def serving_stand_in(servicer: LoraServicer):
    """The stand-in with grpc.health.v1 SERVING (the gateway's /health, which SMG probes, asks it)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    checks = health.HealthServicer()
    checks.set("pagoda.v1.Generation", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


@pytest.fixture(scope="module")
def stack():
    servicer = LoraServicer()
    with serving_stand_in(servicer) as target, Gateway(target, ["--api-key", KEY]) as gateway:
        yield gateway, servicer


@pytest.fixture
def servicer(stack):
    servicer = stack[1]
    servicer.adapters[:] = ["sql"]
    return servicer


def chat(router: SmgRouter, model: str) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/chat/completions", json={"model": model, "messages": MESSAGES,
                                                                "max_tokens": 2}, timeout=30)


def test_smg_with_the_gateway_as_an_openai_worker_passes_model_through(stack, servicer):
    with HttpSmg([stack[0].url], "openai") as router:
        for model, sent in ((BASE, ""), ("sql", "sql")):
            reply = chat(router, model)
            assert reply.status_code == 200 and reply.json()["model"] == model, reply.text
            assert servicer.requests[-1].model == sent
        reply = chat(router, "nope")
        assert reply.status_code == 404 and reply.json()["error"]["param"] == "model", reply.text
        assert "GET /v1/models lists them" in reply.json()["error"]["message"]  # the gateway's answer, not SMG's


def test_smg_with_an_engine_worker_knows_only_the_base_and_an_alias_answers_with_the_base(stack, servicer):
    with HttpSmg([stack[0].url], "sglang") as router:  # the first model of /v1/models is the worker's
        assert chat(router, BASE).status_code == 200
        reply = chat(router, "sql")
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found", reply.text
    before = len(servicer.requests)
    with HttpSmg([stack[0].url], "sglang", ["--model-alias", f"sql={BASE}"]) as router:
        reply = chat(router, "sql")
        assert reply.status_code == 200, reply.text
        assert servicer.requests[-1].model == "" and len(servicer.requests) == before + 1  # the base answered
