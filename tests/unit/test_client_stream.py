"""A client's response stream: queued tokens are merged into one response, except with logprobs."""

from __future__ import annotations

import asyncio

import pytest

from pagoda import model_files
from pagoda.step import SampledToken
from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.client_stream import ClientStream
from scheduler_svc.tokenizer import load_tokenizer, read_model_spec
from scheduler_svc.validation import validate_generate


@pytest.fixture(scope="module")
def tokenizer_and_spec():
    model_dir = model_files.resolve_model(None, weights=False)
    tokenizer = load_tokenizer(model_dir)
    return tokenizer, read_model_spec(model_dir, tokenizer)


@pytest.mark.parametrize("logprobs", [False, True])
def test_tokens_queued_before_the_client_reads(tokenizer_and_spec, logprobs):
    """Three tokens sampled before the client reads: one merged response, or with logprobs one each,
    so every token's text delta is its own (what the OpenAI gateway names logprob tokens by)."""
    tokenizer, spec = tokenizer_and_spec
    req = pb.GenerateRequest(request_id="r", text="Hello")
    req.stopping.max_tokens = 3
    req.response.logprobs = logprobs
    params = validate_generate(req, tokenizer, spec, 2048)
    stream = ClientStream.create(params, tokenizer)
    sample = stream.samples[0]
    words = tokenizer(" one two three", add_special_tokens=False)["input_ids"]
    for i, token_id in enumerate(words):
        stream.on_token(sample, SampledToken("r", token_id, logprob=-0.5), pb.FINISH_REASON_LENGTH if i == len(words) - 1 else None)
    stream.finish_if_done()

    async def collect():
        return [r async for r in stream.responses()]

    responses = asyncio.run(collect())
    outputs = [o for r in responses for o in r.outputs]
    assert "".join(o.text for o in outputs) == " one two three"
    assert [t for o in outputs for t in o.token_ids] == words
    assert responses[-1].usage.completion_tokens == 3
    if logprobs:
        assert [list(o.token_ids) for o in outputs] == [[t] for t in words]
        assert [o.text for o in outputs] == [tokenizer.decode([t]) for t in words]
        assert all(len(o.logprobs) == 1 for o in outputs)
    else:
        assert len(outputs) == 1


@pytest.mark.parametrize("logprobs", [False, True])
def test_the_reasoning_is_split_from_the_answer_token_by_token(tokenizer_and_spec, logprobs):
    """A reasoning parser's split in the stream: `<think>` cut across tokens, `reasoning_text` apart
    from `text`, tags removed, a stop string still matched on the whole text."""
    import dataclasses

    from pagoda.reasoning import get_reasoning_parser

    tokenizer, spec = tokenizer_and_spec
    req = pb.GenerateRequest(request_id="r", text="Hi")
    req.stopping.stop.append("STOP")
    req.response.logprobs = logprobs
    parser = get_reasoning_parser("qwen3")
    params = dataclasses.replace(validate_generate(req, tokenizer, spec, 2048), reasoning=(parser, parser.initial_state("")))
    stream = ClientStream.create(params, tokenizer)
    sample = stream.samples[0]
    words = tokenizer("<think>\n2 and 2</think>\n\nFour.STOP ignored", add_special_tokens=False)["input_ids"]
    for token_id in words:
        if stream.on_token(sample, SampledToken("r", token_id, logprob=-0.5), None) is not None:
            break
    stream.finish_if_done()

    async def collect():
        return [r async for r in stream.responses()]

    responses = asyncio.run(collect())
    outputs = [o for r in responses for o in r.outputs]
    assert "".join(o.reasoning_text for o in outputs) == "\n2 and 2"
    assert "".join(o.text for o in outputs) == "\n\nFour."
    assert outputs[-1].matched_stop == "STOP" and outputs[-1].finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    # the usage counts the tokens whose text is (in part) the reasoning's, "\n2 and 2"; the tags' alone do not
    (usage,) = [r.usage for r in responses if r.HasField("usage")]
    ends = [len(tokenizer.decode(words[:i + 1])) for i in range(len(words))]
    start, end = len("<think>"), len("<think>\n2 and 2")
    inside = [i for i, b in enumerate(ends) if b > start and (ends[i - 1] if i else 0) < end]
    assert usage.reasoning_tokens == len(inside) >= 3
    if logprobs:
        assert sum(len(o.token_ids) for o in outputs) == len(outputs)  # still one token each
