"""Sampling and output options through the real service, against transformers."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pagoda.v1 import generation_pb2 as pb
from tests.service.harness import chat_ids, collect, greedy_request, hf_greedy, Service


@pytest.fixture(scope="module")
def service():
    with Service(scheduler_args=["--max-num-batched-tokens", "256"]) as svc:
        yield svc


def test_logprobs_and_top_logprobs_equal_transformers(service, hf_reference):
    model, tokenizer = hf_reference
    prompt = chat_ids(tokenizer, "Name three fruits.")
    req = greedy_request(prompt_ids=prompt, max_tokens=12)
    req.response.logprobs = True
    req.response.top_logprobs = 5
    out = collect(service.stub.Generate(req, timeout=120))["outputs"][0]
    tokens = out["token_ids"]
    assert tokens == hf_greedy(model, prompt, 12)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert len(out["logprobs"]) == len(tokens)
    for i, entry in enumerate(out["logprobs"]):
        assert entry.token_id == tokens[i]
        assert abs(entry.logprob - reference[i, tokens[i]].item()) < 1e-4
        top = reference[i].topk(5)
        assert [t.token_id for t in entry.top] == top.indices.tolist()
        for t, want in zip(entry.top, top.values.tolist()):
            assert abs(t.logprob - want) < 1e-4


def test_stop_string_split_across_tokens(service, hf_reference):
    model, tokenizer = hf_reference
    prompt = chat_ids(tokenizer, "What is the capital of France? Answer in one sentence.")
    expected = hf_greedy(model, prompt, 24)
    text = tokenizer.decode(expected, skip_special_tokens=True)
    # A stop string that spans a token boundary: the end of one token and the start of the next.
    pieces = [tokenizer.decode([t]) for t in expected]
    k = next(i for i in range(1, len(pieces)) if len(pieces[i - 1].strip()) >= 2 and len(pieces[i].strip()) >= 2)
    stop = pieces[k - 1][-2:] + pieces[k][:2]
    assert stop in text
    req = greedy_request(prompt_ids=prompt, max_tokens=24)
    req.stopping.stop.append(stop)
    out = collect(service.stub.Generate(req, timeout=120))["outputs"][0]
    assert out["finish_reason"] == pb.FINISH_REASON_STOP_SEQUENCE
    assert out["matched_stop"] == stop
    assert out["text"] == text[: text.index(stop)]
    req.stopping.include_stop_str_in_output = True
    out = collect(service.stub.Generate(req, timeout=120))["outputs"][0]
    assert out["text"] == text[: text.index(stop) + len(stop)]


def test_emoji_answer_streams_valid_utf8(service, hf_reference):
    _, tokenizer = hf_reference
    prompt = chat_ids(tokenizer, "Repeat exactly, nothing else: 🎉🚀🌍✨ café 日本 👩‍👩‍👧")
    result = collect(service.stub.Generate(greedy_request(prompt_ids=prompt, max_tokens=40), timeout=120))
    out = result["outputs"][0]
    deltas = [o.text for m in result["messages"] for o in m.outputs]
    assert all("\ufffd" not in d for d in deltas)
    # The stream ends on whole characters: a character cut off by max_tokens is never sent.
    assert out["text"] == tokenizer.decode(out["token_ids"], skip_special_tokens=True).rstrip("\ufffd")
    multi_token_chars = [c for c in out["text"] if len(tokenizer.encode(c, add_special_tokens=False)) > 1]
    assert multi_token_chars, out["text"]  # some character really was split across tokens


def _seeded(prompt, seed, n=1):
    req = pb.GenerateRequest()
    req.token_ids.ids.extend(prompt)
    req.sampling.temperature = 0.9
    req.sampling.top_p = 0.95
    req.sampling.seed = seed
    req.sampling.n = n
    req.stopping.max_tokens = 24
    req.stopping.ignore_eos = True
    return req


def test_same_seed_same_tokens_alone_and_in_a_busy_batch(service, hf_reference):
    _, tokenizer = hf_reference
    prompt = chat_ids(tokenizer, "Invent a name for a cat.")
    alone = collect(service.stub.Generate(_seeded(prompt, 42), timeout=120))["outputs"][0]["token_ids"]
    others = [chat_ids(tokenizer, f"Count to {i}.") for i in range(3, 9)]

    def run(i):
        if i == 3:
            return collect(service.stub.Generate(_seeded(prompt, 42), timeout=300))
        return collect(service.stub.Generate(_seeded(others[i % len(others)], 1000 + i), timeout=300))

    with ThreadPoolExecutor(7) as pool:
        results = list(pool.map(run, range(7)))
    assert results[3]["outputs"][0]["token_ids"] == alone
    different_seed = collect(service.stub.Generate(_seeded(prompt, 43), timeout=120))["outputs"][0]["token_ids"]
    assert different_seed != alone


def test_n3_streams_three_indexed_outputs(service, hf_reference):
    _, tokenizer = hf_reference
    result = collect(service.stub.Generate(_seeded(chat_ids(tokenizer, "Say something."), 7, n=3), timeout=300))
    assert sorted(result["outputs"]) == [0, 1, 2]
    assert all(len(o["token_ids"]) == 24 and o["finish_reason"] == pb.FINISH_REASON_LENGTH for o in result["outputs"].values())
    assert result["last"].usage.completion_tokens == 72
    assert len({tuple(o["token_ids"]) for o in result["outputs"].values()}) == 3


def test_metrics_endpoint_reports_vllm_style_metrics(service):
    body = urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=10).read().decode()
    for name in (
        "pagoda:time_to_first_token_seconds_bucket",
        "pagoda:inter_token_latency_seconds_bucket",
        "pagoda:e2e_request_latency_seconds_count",
        "pagoda:num_requests_running",
        "pagoda:num_requests_waiting",
        "pagoda:kv_cache_usage_perc",
        "pagoda:prefix_cache_queries_total",
        "pagoda:prefix_cache_hits_total",
        "pagoda:num_preemptions_total",
        "pagoda:generation_tokens_total",
        'pagoda:routing_decisions_total{reason="least_loaded"}',
    ):
        assert name in body, name
    generated = next(float(line.split()[-1]) for line in body.splitlines() if line.startswith("pagoda:generation_tokens_total"))
    assert generated > 0
