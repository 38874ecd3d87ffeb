"""The whole path: gRPC stream -> scheduler -> ZeroMQ -> executor, against transformers."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagoda.v1 import generation_pb2 as pb
from tests.service.harness import chat_ids, collect, greedy_request, hf_greedy, Service

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
    "Explain photosynthesis in one sentence.",
    "What is 17 times 23?",
    "Name a famous painting by Leonardo da Vinci.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def service():
    with Service(scheduler_args=["--max-num-batched-tokens", "256"]) as svc:
        yield svc


def test_concurrent_chats_equal_transformers_greedy(service, hf_reference):
    model, tokenizer = hf_reference

    def run(content):
        return collect(service.stub.Generate(greedy_request(chat=[("user", content)], max_tokens=MAX_TOKENS), timeout=300))

    with ThreadPoolExecutor(len(CHATS)) as pool:
        results = list(pool.map(run, CHATS))
    for content, result in zip(CHATS, results):
        prompt = chat_ids(tokenizer, content)
        expected = hf_greedy(model, prompt, MAX_TOKENS)
        out = result["outputs"][0]
        assert result["first"].prompt_info.num_prompt_tokens == len(prompt)
        assert out["token_ids"] == expected, content
        assert out["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        last = result["last"]
        assert last.usage.prompt_tokens == len(prompt) and last.usage.completion_tokens == len(expected)
        expected_reason = pb.FINISH_REASON_EOS if expected[-1] in (2,) and len(expected) < MAX_TOKENS else pb.FINISH_REASON_LENGTH
        assert out["finish_reason"] == expected_reason
    assert service.wait_all_blocks_free().executors[0].num_free_blocks == service.server_info().executors[0].num_total_blocks


def test_tokenize_matches_the_chat_template(service, hf_reference):
    _, tokenizer = hf_reference
    req = pb.TokenizeRequest()
    req.chat.messages.add(role="user", content=CHATS[0])
    assert list(service.stub.Tokenize(req, timeout=30).token_ids) == chat_ids(tokenizer, CHATS[0])


def test_model_info(service):
    info = service.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.max_model_len == 8192 and info.vocab_size == 49152 and 2 in info.eos_token_ids
    assert info.block_size == 16 and info.name


def test_stop_token_ids_and_max_tokens(service, hf_reference):
    model, tokenizer = hf_reference
    prompt = chat_ids(tokenizer, CHATS[1])
    expected = hf_greedy(model, prompt, 16)
    stop_at = expected[5]
    req = greedy_request(prompt_ids=prompt, max_tokens=16)
    req.stopping.stop_token_ids.append(stop_at)
    out = collect(service.stub.Generate(req, timeout=120))["outputs"][0]
    assert out["token_ids"] == expected[: expected.index(stop_at) + 1]
    assert out["finish_reason"] == pb.FINISH_REASON_STOP_TOKEN


def test_cancelled_and_aborted_requests_free_their_blocks(service, hf_reference):
    _, tokenizer = hf_reference
    prompt = chat_ids(tokenizer, CHATS[2])
    call = service.stub.Generate(greedy_request(prompt_ids=prompt, max_tokens=400, request_id="to-cancel"), timeout=120)
    next(call)  # the request runs
    call.cancel()
    aborted = service.stub.Generate(greedy_request(prompt_ids=prompt, max_tokens=400, request_id="to-abort"), timeout=120)
    first = next(aborted)
    assert first.request_id == "to-abort"
    service.stub.Abort(pb.AbortRequest(request_ids=["to-abort", "unknown-id"]), timeout=10)
    rest = list(aborted)
    assert rest[-1].outputs[-1].finish_reason == pb.FINISH_REASON_ABORTED
    service.stub.Abort(pb.AbortRequest(request_ids=["to-abort"]), timeout=10)  # idempotent
    info = service.wait_all_blocks_free()
    assert info.num_running == 0 and info.num_waiting == 0
    assert all(e.num_free_blocks == e.num_total_blocks for e in info.executors)


def _bad_requests(vocab_size: int):
    def base(**kw):
        req = greedy_request(prompt_ids=[1, 2, 3], max_tokens=4)
        return req

    cases = []
    req = pb.GenerateRequest()
    cases.append(("prompt", req))
    req = pb.GenerateRequest(text="")
    cases.append(("prompt.text", req))
    req = pb.GenerateRequest()
    req.chat.SetInParent()
    cases.append(("prompt.chat.messages", req))
    req = base()
    req.token_ids.ids.append(vocab_size + 5)
    cases.append(("prompt.token_ids", req))
    req = greedy_request(prompt_ids=[5] * 9000, max_tokens=4)
    cases.append(("prompt", req))
    req = greedy_request(prompt_ids=[5] * 100, max_tokens=8100)
    cases.append(("stopping.max_tokens", req))
    for field, value in [
        ("temperature", -0.5),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("repetition_penalty", 0.0),
        ("n", 100),
    ]:
        req = base()
        setattr(req.sampling, field, value)
        cases.append((f"sampling.{field}", req))
    req = base()
    req.stopping.stop.append("")
    cases.append(("stopping.stop", req))
    req = base()
    req.response.top_logprobs = 21
    cases.append(("response.top_logprobs", req))
    return cases


def test_bad_inputs_get_invalid_argument_naming_the_field(service, hf_reference):
    model, tokenizer = hf_reference
    prompt = chat_ids(tokenizer, CHATS[4])
    before = collect(service.stub.Generate(greedy_request(prompt_ids=prompt, max_tokens=12), timeout=120))
    for field, req in _bad_requests(49152):
        with pytest.raises(grpc.RpcError) as err:
            list(service.stub.Generate(req, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value.details())
        assert err.value.details().startswith(field), (field, err.value.details())
    after = collect(service.stub.Generate(greedy_request(prompt_ids=prompt, max_tokens=12), timeout=120))
    assert after["outputs"][0]["token_ids"] == before["outputs"][0]["token_ids"]
    info = service.wait_all_blocks_free()
    assert all(e.num_free_blocks == e.num_total_blocks for e in info.executors)


def test_embed_and_rerank_to_a_generation_model_name_the_model(service):
    for call, req in ((service.stub.Embed, pb.EmbedRequest(texts=["hello"])),
                      (service.stub.Rerank, pb.RerankRequest(query="hello", documents=["world"]))):
        with pytest.raises(grpc.RpcError) as err:
            call(req, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("model:")


def test_duplicate_in_flight_request_id_is_refused(service, hf_reference):
    _, tokenizer = hf_reference
    prompt = chat_ids(tokenizer, CHATS[3])
    first = service.stub.Generate(greedy_request(prompt_ids=prompt, max_tokens=300, request_id="dup"), timeout=120)
    next(first)
    with pytest.raises(grpc.RpcError) as err:
        list(service.stub.Generate(greedy_request(prompt_ids=prompt, max_tokens=4, request_id="dup"), timeout=30))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "request_id" in err.value.details()
    service.stub.Abort(pb.AbortRequest(request_ids=["dup"]), timeout=10)
    list(first)
    # Once finished, the id may be used again.
    again = collect(service.stub.Generate(greedy_request(prompt_ids=prompt, max_tokens=4, request_id="dup"), timeout=60))
    assert len(again["outputs"][0]["token_ids"]) == 4
    info = service.wait_all_blocks_free()
    assert all(e.num_free_blocks == e.num_total_blocks for e in info.executors)


def test_long_prompt_beyond_the_step_budget_beside_short_ones(hf_reference):
    """Budget 64 tokens a step: a 1,000+ token prompt is chunked and mixed with running decodes."""
    model, tokenizer = hf_reference
    long_text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(90))
    long_prompt = chat_ids(tokenizer, "Summarize this list in one sentence:\n" + long_text)
    assert len(long_prompt) > 1000
    shorts = [chat_ids(tokenizer, c) for c in CHATS[:3]]
    with Service(scheduler_args=["--max-num-batched-tokens", "64"]) as svc:
        results = {}

        def run(key, ids, n):
            results[key] = collect(svc.stub.Generate(greedy_request(prompt_ids=ids, max_tokens=n), timeout=600))

        threads = [threading.Thread(target=run, args=(f"s{i}", ids, 24)) for i, ids in enumerate(shorts)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # the short ones are decoding when the long one arrives
        run("long", long_prompt, 8)
        for t in threads:
            t.join()
        assert results["long"]["outputs"][0]["token_ids"] == hf_greedy(model, long_prompt, 8)
        for i, ids in enumerate(shorts):
            assert results[f"s{i}"]["outputs"][0]["token_ids"] == hf_greedy(model, ids, 24)
        info = svc.wait_all_blocks_free()
        assert all(e.num_free_blocks == e.num_total_blocks for e in info.executors)
