"""Speculative decoding end to end: `--speculative-method ngram --num-speculative-tokens 4`.

Greedy streams equal transformers' greedy output token for token (the executor and the
core are also checked in tests/executor/test_spec_decode.py); logprobs come with each
accepted token, `Usage.accepted_draft_tokens` counts the drafts, the vLLM-named
counters are exported, beam search is refused with a message naming the field, and
every block is free afterwards.
"""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.service.harness import Service, chat_ids, collect, greedy_request, hf_greedy

SPEC_ARGS = ["--speculative-method", "ngram", "--num-speculative-tokens", "4", "--max-num-batched-tokens", "32"]
PARAGRAPH = "Pagoda serves language models over gRPC. It keeps the KV cache in blocks and schedules every step."


def test_speculative_service(hf_reference):
    model, tokenizer = hf_reference
    prompts = [
        chat_ids(tokenizer, f"Repeat this text exactly, word for word: {PARAGRAPH}"),  # drafts mostly accepted
        chat_ids(tokenizer, "Write a haiku about the sea."),  # drafts mostly rejected or none
    ]
    with Service(scheduler_args=SPEC_ARGS) as svc:
        with ThreadPoolExecutor(len(prompts)) as pool:
            requests = [greedy_request(prompt_ids=p, max_tokens=40, ignore_eos=True) for p in prompts]
            for request in requests:
                request.response.logprobs = True
            results = list(pool.map(lambda r: collect(svc.stub.Generate(r, timeout=300)), requests))
        for prompt, result in zip(prompts, results):
            out = result["outputs"][0]
            assert out["token_ids"] == hf_greedy(model, prompt, 40, ignore_eos=True)
            assert [lp.token_id for lp in out["logprobs"]] == out["token_ids"]
            assert all(lp.logprob <= 0.0 for lp in out["logprobs"])
        usage = results[0]["last"].usage
        assert usage.completion_tokens == 40 and usage.accepted_draft_tokens >= 10

        with pytest.raises(grpc.RpcError) as error:
            beam = greedy_request(prompt_ids=prompts[1], max_tokens=4)
            beam.sampling.beam_width = 2
            collect(svc.stub.Generate(beam, timeout=60))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.beam_width" in error.value.details()

        # n = 2 seeded samples with a stop string: reproducible, and the stop string holds
        def sampled():
            request = greedy_request(prompt_ids=prompts[0], max_tokens=30)
            request.sampling.temperature, request.sampling.seed, request.sampling.n = 0.7, 11, 2
            request.stopping.stop.append("blocks")
            return collect(svc.stub.Generate(request, timeout=300))["outputs"]

        first, second = sampled(), sampled()
        assert [first[i]["token_ids"] for i in (0, 1)] == [second[i]["token_ids"] for i in (0, 1)]
        for out in first.values():
            assert "blocks" not in out["text"]

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=10).read().decode()
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
            assert f"pagoda:spec_decode_{name}" in metrics
        info = svc.wait_all_blocks_free()
        assert all(e.num_free_blocks == e.num_total_blocks for e in info.executors)
