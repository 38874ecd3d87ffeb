"""Client and AsyncClient against the real service (scheduler + one CPU executor)."""

from __future__ import annotations

import asyncio

import pytest

from pagoda.client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    FinishReason,
    InvalidArgument,
    RetryPolicy,
)
from tests.client.services import EXECUTOR_ARGS, target
from tests.service.harness import Service, chat_ids, free_port, hf_greedy, one_torch_thread

pytestmark = pytest.mark.timeout(600)

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def svc():
    with Service(executor_args=EXECUTOR_ARGS) as service:
        yield service


@pytest.fixture(scope="module")
def client(svc):
    with Client(target(svc), timeout=120) as c:
        yield c


def test_chat_streams_transformers_greedy_tokens_as_text_deltas(client, hf_reference):
    model, tokenizer = hf_reference
    chunks = list(client.chat([{"role": "user", "content": QUESTION}], max_tokens=24, temperature=0.0))
    ids = [t for c in chunks for t in c.token_ids]
    with one_torch_thread():
        expected = hf_greedy(model, chat_ids(tokenizer, QUESTION), 24)
    assert ids == expected
    assert "".join(c.text for c in chunks) == tokenizer.decode(expected, skip_special_tokens=True)
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].finish_reason in (FinishReason.EOS, FinishReason.LENGTH)


def test_text_and_token_id_prompts_give_the_same_stream_and_usage(client):
    prompt = "The three primary colors are"
    tokens = client.tokenize(prompt)
    assert len(tokens.token_ids) == len(tokens.tokens) > 0
    by_text = client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    text = by_text.collect()
    by_ids = client.generate(list(tokens.token_ids), max_tokens=12, temperature=0.0, ignore_eos=True).collect()
    assert text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert text.text == by_ids.text
    assert by_text.usage.prompt_tokens == len(tokens.token_ids) and by_text.usage.completion_tokens == 12
    assert text.outputs[0].finish_reason is FinishReason.LENGTH


def test_chunks_carry_one_logprob_per_token_with_top_alternatives(client):
    chunks = list(client.generate("Once upon a time", max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=3,
                                  ignore_eos=True))
    for chunk in chunks:
        assert [lp.token_id for lp in chunk.logprobs] == list(chunk.token_ids)
        for lp in chunk.logprobs:
            assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id  # greedy: the top choice
            assert lp.logprob <= 0 and abs(lp.top[0].logprob - lp.logprob) < 1e-5


def test_n_samples_arrive_by_index(client):
    result = client.generate("Colors:", max_tokens=6, temperature=1.0, seed=7, n=3, ignore_eos=True).collect()
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 6 for o in result.outputs)


def test_bad_parameters_raise_invalid_argument_naming_the_field(client):
    with pytest.raises(InvalidArgument, match=r"sampling\.top_p"):
        list(client.generate("hi", top_p=1.5))
    with pytest.raises(TypeError, match="top_q"):
        client.generate("hi", top_q=0.5)


def test_a_deadline_ends_the_stream_with_deadline_exceeded_and_frees_its_blocks(svc, client):
    with pytest.raises(DeadlineExceeded):
        list(client.generate("Count to a thousand:", max_tokens=2000, ignore_eos=True, temperature=0.0, timeout=1.0))
    info = svc.wait_all_blocks_free()
    assert info.num_running == 0


def test_breaking_out_of_a_stream_cancels_the_request(svc, client):
    stream = client.generate("Write an essay about rivers.", max_tokens=2000, ignore_eos=True, temperature=0.0)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    info = svc.wait_all_blocks_free()
    assert info.num_running == 0 and all(e.num_free_blocks == e.num_total_blocks for e in info.executors)


def test_model_and_server_info(svc, client):
    model = client.model_info()
    assert model.name and model.vocab_size > 0 and model.max_model_len > 0 and model.eos_token_ids
    assert model.block_size == 16
    info = client.server_info()
    assert len(info.executors) == 1 and info.executors[0].healthy and info.executors[0].device == "cpu"


def test_an_unreachable_first_address_is_skipped(svc):
    dead = f"127.0.0.1:{free_port()}"
    with Client([dead, target(svc)], retry=RetryPolicy(initial_backoff=0.05), timeout=120) as c:
        assert c.model_info().vocab_size > 0
        stream = c.generate("Hello", max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(stream.collect().outputs[0].token_ids) == 4
        assert stream.num_attempts == 2


def test_async_client_streams_what_the_sync_client_streams(svc, client):
    expected = client.chat([{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0.0).collect()

    async def run():
        async with AsyncClient(target(svc), timeout=120) as ac:
            stream = ac.chat([("user", QUESTION)], max_tokens=16, temperature=0.0)
            chunks = [c async for c in stream]
            info = await ac.model_info()
            tokens = await ac.tokenize(messages=[{"role": "user", "content": QUESTION}])
            return chunks, stream.usage, info, tokens

    chunks, usage, info, tokens = asyncio.run(run())
    assert "".join(c.text for c in chunks) == expected.text
    assert usage.prompt_tokens == len(tokens.token_ids) == expected.usage.prompt_tokens
    assert info.name == client.model_info().name


def test_health_is_serving_and_a_dead_address_is_not(svc):
    with Client(target(svc)) as c:
        assert c.health()
    with Client(f"127.0.0.1:{free_port()}") as c:
        assert not c.health(timeout=0.5)
