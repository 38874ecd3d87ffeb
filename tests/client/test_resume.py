"""Resumable streams: a scheduler killed and started again mid-stream is invisible to the caller.

Two services A and B (a scheduler and an executor each). A client with both addresses
streams a greedy and a seeded request from A; once both have tokens, A's scheduler is
SIGKILLed and started again. The client continues each stream on B from the prompt plus
the tokens received so far; the caller's text and token ids equal an unbroken run's.
"""

from __future__ import annotations

import threading

import pytest

from pagoda.client import Client, FinishReason, RetryPolicy
from tests.client.services import EXECUTOR_ARGS, kill_scheduler, start_scheduler_again, target
from tests.service.harness import Service

pytestmark = pytest.mark.timeout(600)

CHAT = [{"role": "user", "content": "Tell me a long story about a cat who learns to sail."}]
MAX_TOKENS = 96
REQUESTS = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=0.9, top_p=0.95, seed=20261201),
}


@pytest.fixture(scope="module")
def services():
    with Service(executor_args=EXECUTOR_ARGS) as a, Service(executor_args=EXECUTOR_ARGS) as b:
        yield a, b


def _consume(stream, sink: dict, started: threading.Event, errors: list, after: int = 4) -> None:
    try:
        for chunk in stream:
            sink["token_ids"].extend(chunk.token_ids)
            sink["text"] += chunk.text
            if chunk.finish_reason is not None:
                sink["finish_reason"] = chunk.finish_reason
            if len(sink["token_ids"]) >= after:
                started.set()
    except BaseException as exc:  # reported by the test thread
        errors.append(exc)
    finally:
        started.set()


def test_streams_resume_exactly_after_the_scheduler_is_killed_and_restarted(services):
    a, b = services
    with Client([target(b)]) as unbroken:
        reference = {name: unbroken.chat(CHAT, max_tokens=MAX_TOKENS, ignore_eos=True, **p).collect()
                     for name, p in REQUESTS.items()}

    with Client([target(a), target(b)]) as client:
        streams = {name: client.chat(CHAT, max_tokens=MAX_TOKENS, ignore_eos=True, **p)
                   for name, p in REQUESTS.items()}
        received = {name: {"token_ids": [], "text": "", "finish_reason": None} for name in REQUESTS}
        started = {name: threading.Event() for name in REQUESTS}
        errors: list = []
        threads = [threading.Thread(target=_consume, args=(streams[n], received[n], started[n], errors))
                   for n in REQUESTS]
        for t in threads:
            t.start()
        for event in started.values():
            assert event.wait(240)
        at_kill = {name: len(r["token_ids"]) for name, r in received.items()}
        kill_scheduler(a)
        start_scheduler_again(a)
        for t in threads:
            t.join(240)
        assert not errors, errors

    for name, ref in reference.items():
        got = received[name]
        assert at_kill[name] < MAX_TOKENS, f"{name}: finished before the kill, nothing to resume"
        assert streams[name].num_attempts >= 2, f"{name}: the stream never broke"
        assert got["token_ids"] == ref.outputs[0].token_ids, name
        assert got["text"] == ref.text, name
        assert got["finish_reason"] is FinishReason.LENGTH
        assert streams[name].usage.completion_tokens == MAX_TOKENS
        assert streams[name].usage.prompt_tokens == ref.usage.prompt_tokens

    # A is back: the same greedy request served by the restarted scheduler is the same again.
    a.wait_serving(1)
    with Client([target(a)]) as again:
        assert again.chat(CHAT, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0).collect().text == \
            reference["greedy"].text


def test_a_stream_resumes_on_the_same_address_once_its_scheduler_is_back(services):
    a, _ = services
    a.wait_serving(1)
    patient = RetryPolicy(max_attempts=60, max_backoff=2.0)  # a restart on a loaded machine takes a while
    with Client([target(a)], retry=patient) as client:
        reference = client.chat(CHAT, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0).collect()
        stream = client.chat(CHAT, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
        got = {"token_ids": [], "text": "", "finish_reason": None}
        started, errors = threading.Event(), []
        consumer = threading.Thread(target=_consume, args=(stream, got, started, errors, 8))
        consumer.start()
        assert started.wait(240)
        kill_scheduler(a)
        start_scheduler_again(a)  # the client retries with backoff until it answers
        consumer.join(240)
    assert not errors, errors
    assert stream.num_attempts >= 2
    assert got["token_ids"] == reference.outputs[0].token_ids
    assert got["text"] == reference.text
