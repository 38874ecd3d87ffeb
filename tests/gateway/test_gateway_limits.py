"""The gateway under attack (issue #24): each test is an attacker's request and the answer it must
get. The scheduler behind the gateway is a stand-in that requires an API key (as `--api-key`
does) and counts the streams it is asked to open; the gateway is its own process.

Before: bodies were read (and parsed) before the key was checked, with no size limit; seven
inputs gave a 500; a completion of 3,000 prompts opened 3,000 streams.
"""

from __future__ import annotations

import json
import socket
import time

import httpx2 as httpx
import pytest

from gateway_svc import schemas
from tests.client.keyed_server import KEY, KeyedServicer, insecure_keyed_server
from tests.gateway.gateway import Gateway

pytestmark = pytest.mark.timeout(300)

AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
LIMIT = 1 << 20  # the gateway's --max-request-bytes in these tests


class CountingServicer(KeyedServicer):
    def __init__(self):
        self.num_generate = 0

    def Generate(self, request, context):
        self.num_generate += 1
        yield from super().Generate(request, context)


@pytest.fixture(scope="module")
def stack():
    servicer = CountingServicer()
    with insecure_keyed_server(servicer) as target, Gateway(target, ["--max-request-bytes", str(LIMIT)]) as gateway:
        yield gateway, servicer


def rss_bytes(gateway: Gateway) -> int:
    with open(f"/proc/{gateway.proc.pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


def raw_request(gateway: Gateway, head: str, body_chunks=(), timeout: float = 10.0) -> tuple[int, dict, float]:
    """Send `head` (and then `body_chunks` while the gateway listens) on a plain socket; return the
    status, the JSON body and the seconds until the answer began."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=timeout) as sock:
        start = time.monotonic()
        sock.sendall(head.encode("latin-1") if isinstance(head, str) else head)
        for chunk in body_chunks:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break  # the gateway answered and closed: it read no further
        reply = b""
        while b"\r\n\r\n" not in reply:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
        took = time.monotonic() - start
        head_bytes, _, rest = reply.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head_bytes.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(rest) < length:
            data = sock.recv(65536)
            if not data:
                break
            rest += data
    status = int(head_bytes.split(b" ")[1])
    return status, json.loads(rest[:length] or b"{}"), took


def post_head(path: str, length: int | None, auth: str | None = None) -> str:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    if auth:
        lines.append(f"Authorization: {auth}")
    return "\r\n".join(lines) + "\r\n\r\n"


def chunked(total: int, size: int = 1 << 20):
    for _ in range(total // size):
        yield f"{size:x}\r\n".encode() + b" " * size + b"\r\n"


def test_a_caller_without_a_key_is_refused_before_its_body_is_read(stack):
    gateway, _ = stack
    before = rss_bytes(gateway)
    for _ in range(3):  # three 256 MB bodies announced, none sent: the answer comes at once
        status, body, took = raw_request(gateway, post_head("/v1/chat/completions", 256 << 20))
        assert status == 401 and body["error"]["type"] == "authentication_error", body
        assert took < 5, took
    status, body, _ = raw_request(gateway, post_head("/v1/chat/completions", None), chunked(64 << 20))
    assert status == 401, body  # chunked: refused without reading 64 MB
    assert rss_bytes(gateway) - before < 64 << 20


def test_a_body_over_the_limit_is_413_in_openai_shape_even_with_a_key(stack):
    gateway, _ = stack
    before = rss_bytes(gateway)
    status, body, took = raw_request(gateway, post_head("/v1/chat/completions", 66 << 20, f"Bearer {KEY}"))
    assert status == 413 and took < 5
    assert set(body["error"]) == {"message", "type", "param", "code"} and "bytes" in body["error"]["message"]
    status, body, _ = raw_request(gateway, post_head("/v1/chat/completions", None, f"Bearer {KEY}"),
                                  chunked(32 << 20))
    assert status == 413, body  # no Content-Length: refused once the limit is passed
    assert rss_bytes(gateway) - before < 64 << 20


def test_a_body_full_of_tiny_messages_is_refused_fast_and_others_are_served(stack):
    gateway, servicer = stack
    message = {"role": "user", "content": ""}
    count = LIMIT // (len(json.dumps(message)) + 2) - 100  # as many as fit the limit (~23,000)
    flood = json.dumps({"messages": [message] * count}).encode()
    assert len(flood) < LIMIT
    start = time.monotonic()
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", content=flood, headers=AUTH, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages", reply.text
    assert time.monotonic() - start < 5
    before = servicer.num_generate
    assert httpx.post(f"{gateway.url}/v1/chat/completions", json=CHAT, headers=AUTH, timeout=30).status_code == 200
    assert servicer.num_generate == before + 1


@pytest.mark.parametrize("field, value, param", [
    ("messages", [{"role": "user", "content": "\ud800"}], "messages.0.content"),  # a lone surrogate
    ("max_tokens", 2 ** 70, "max_tokens"),
    ("logit_bias", {"-1": 1}, "logit_bias"),
    ("logit_bias", {str(10 ** 20): 1}, "logit_bias"),
    ("logit_bias", {"5": 1e9}, "logit_bias"),
    ("top_k", 2 ** 40, "top_k"),
    ("min_tokens", -5, "min_tokens"),
    ("stop", ["x"] * 17, "stop"),
    ("n", 10 ** 6, "n"),
    ("seed", 2 ** 70, "seed"),
])
def test_inputs_that_gave_500_are_400_naming_the_field(stack, field, value, param):
    gateway, servicer = stack
    before = servicer.num_generate
    body = json.dumps({**CHAT, field: value})  # ASCII: a lone surrogate travels as "\\ud800"
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", content=body, headers=AUTH, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert servicer.num_generate == before  # refused before any gRPC call


def test_a_non_latin1_authorization_header_is_401(stack):
    gateway, _ = stack
    head = post_head("/v1/chat/completions", 2).encode().replace(
        b"\r\n\r\n", "\r\nAuthorization: Bearer clé-ключ\r\n\r\n".encode("utf-8"))
    status, body, _ = raw_request(gateway, head + b"{}")
    assert status == 401 and body["error"]["type"] == "authentication_error", body


def test_a_completion_of_3000_prompts_opens_no_stream(stack):
    gateway, servicer = stack
    before = servicer.num_generate
    reply = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": ["Hi"] * 3000, "max_tokens": 1},
                       headers=AUTH, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt", reply.text
    assert f"at most {schemas.MAX_PROMPTS}" in reply.json()["error"]["message"]
    assert servicer.num_generate == before
    reply = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": ["Hi"] * 3, "max_tokens": 1},
                       headers=AUTH, timeout=30)
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 3
    assert servicer.num_generate == before + 3


def test_malformed_json_names_the_position_and_unknown_fields_are_refused(stack):
    gateway, _ = stack
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", content=b'{"messages": [}', headers=AUTH)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] is None and "line 1 column 15" in error["message"], error
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json={**CHAT, "temprature": 0}, headers=AUTH)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "temprature"
    assert reply.json()["error"]["message"] == "Unrecognized request argument supplied: temprature"
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", headers=AUTH,
                       json={**CHAT, "functions": [{"name": "f"}]})  # the legacy form of tools
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "functions"
    assert "not supported" in reply.json()["error"]["message"]
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json={**CHAT, "tools": [], "tool_choice": "none"},
                       headers=AUTH)
    assert reply.status_code == 200, reply.text  # unset or empty: nothing asked


def test_the_models_list_needs_the_key_too(stack):
    gateway, _ = stack
    assert httpx.get(f"{gateway.url}/v1/models").status_code == 401
    assert httpx.get(f"{gateway.url}/v1/models", headers=AUTH).json()["data"][0]["id"] == "keyed"
    assert httpx.get(f"{gateway.url}/metrics").status_code == 200  # /health and /metrics stay open


def test_the_gateway_limits_are_the_schedulers():
    from scheduler_svc import validation

    for name in ("MAX_N", "MAX_TOP_LOGPROBS", "MAX_STOP_STRINGS", "MAX_LOGIT_BIAS_ENTRIES", "MAX_ABS_LOGIT_BIAS"):
        assert getattr(schemas, name) == getattr(validation, name), name
    from gateway_svc import pooling
    from scheduler_svc import pooling_requests

    assert pooling.MAX_INPUTS == pooling_requests.MAX_POOL_INPUTS


def test_the_port_reads_pagoda_gateway_port_not_the_schedulers_variable(monkeypatch):
    from gateway_svc.__main__ import parse_args

    monkeypatch.setenv("PAGODA_PORT", "50051")
    assert parse_args([]).port == 8000
    monkeypatch.setenv("PAGODA_GATEWAY_PORT", "8123")
    assert parse_args([]).port == 8123


@pytest.mark.parametrize("body", [
    b"[" * 100_000,                            # nested past Python's recursion limit
    b'{"max_tokens": ' + b"9" * 5000 + b"}",   # an integer past Python's 4,300 digits
    b"\xff\xfe\x00{",                          # not UTF-8
    b"[]",                                     # JSON, but not an object
])
def test_bodies_the_json_parser_chokes_on_are_400(stack, body):
    gateway, _ = stack
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", content=body, headers=AUTH, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error"
