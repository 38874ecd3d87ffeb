"""OpenAI's list-form message content through the gateway (issue #43): text parts reach the scheduler
joined with newlines (as vLLM joins them), with an image_url part the parts in order
(`ChatMessage.parts`, issue 40), anything else is a 400 naming the part before any gRPC call. Before: any list-form content was a 500 (an AttributeError in the translation).

The scheduler is a stand-in that records the requests it is sent; the gateway is its own process.
"""

from __future__ import annotations

import httpx2 as httpx
import pytest

from tests.client.keyed_server import KEY, KeyedServicer, insecure_keyed_server
from tests.gateway.gateway import Gateway

pytestmark = pytest.mark.timeout(120)

AUTH = {"Authorization": f"Bearer {KEY}"}


class RecordingServicer(KeyedServicer):
    def __init__(self):
        self.requests = []

    def Generate(self, request, context):
        self.requests.append(request)
        yield from super().Generate(request, context)


@pytest.fixture(scope="module")
def stack():
    servicer = RecordingServicer()
    with insecure_keyed_server(servicer) as target, Gateway(target) as gateway:
        yield gateway, servicer


def chat(gateway: Gateway, messages: list[dict]) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2},
                      headers=AUTH, timeout=30)


def test_text_parts_reach_the_scheduler_joined_with_newlines(stack):
    gateway, servicer = stack
    reply = chat(gateway, [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": []},
        {"role": "user", "content": "plain"},
    ])
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "ok!"
    sent = servicer.requests[-1].chat.messages
    assert [(m.role, m.content) for m in sent] == [
        ("system", "Be brief."), ("user", "hi\nthere"), ("assistant", ""), ("user", "plain")]


def test_image_url_parts_reach_the_scheduler_as_parts_in_order(stack):
    gateway, servicer = stack
    url = "data:image/png;base64,AAAA"
    reply = chat(gateway, [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url, "detail": "auto"}},
        {"type": "text", "text": "Briefly."}]}])
    assert reply.status_code == 200, reply.text
    sent = servicer.requests[-1].chat.messages[0]
    assert sent.content == "" and [(p.WhichOneof("kind"), p.text or p.image.url) for p in sent.parts] == [
        ("text", "What is this?"), ("image", url), ("text", "Briefly.")]


def test_responses_and_messages_images_reach_the_scheduler_as_parts_in_order(stack):
    """Responses' input_image parts and Anthropic's image blocks (base64 as a data: URL, or a URL)
    become the same ChatMessage.parts as chat's image_url parts (issue 41 point 4)."""
    gateway, servicer = stack
    reply = httpx.post(f"{gateway.url}/v1/responses", headers=AUTH, timeout=30, json={
        "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"}]}],
        "max_output_tokens": 2, "store": False})
    assert reply.status_code == 200, reply.text
    sent = servicer.requests[-1].chat.messages[0]
    assert [(p.WhichOneof("kind"), p.text or p.image.url) for p in sent.parts] == [
        ("text", "What is this?"), ("image", "data:image/png;base64,AAAA")]
    reply = httpx.post(f"{gateway.url}/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                       timeout=30, json={"max_tokens": 2, "messages": [{"role": "user", "content": [
                           {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "BBBB"}},
                           {"type": "text", "text": "And this?"},
                           {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]})
    assert reply.status_code == 200, reply.text
    sent = servicer.requests[-1].chat.messages[0]
    assert sent.content == "" and [(p.WhichOneof("kind"), p.text or p.image.url) for p in sent.parts] == [
        ("image", "data:image/jpeg;base64,BBBB"), ("text", "And this?"), ("image", "https://example.com/a.png")]


@pytest.mark.parametrize("part, param, words", [
    ({"type": "image_url", "image_url": {"detail": "low"}}, "messages.0.content.1.image_url.url", "required"),
    ({"type": "input_image", "image_url": "data:image/png;base64,AAAA"}, "messages.0.content.1", "image_url"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "messages.0.content.1",
     "'input_audio' is not supported"),
    ({"type": "text"}, "messages.0.content.1.text", "required"),
])
def test_parts_other_than_text_are_400_naming_the_part_before_any_grpc_call(stack, part, param, words):
    gateway, servicer = stack
    before = len(servicer.requests)
    reply = chat(gateway, [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}])
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(f"{param}: ") and words in error["message"], error
    assert len(servicer.requests) == before
