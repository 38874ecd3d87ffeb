"""Beam search through the real service against transformers' `generate(num_beams=4)`.

The default model, chat prompts some of whose best beams end on EOS, beam_width 4 and
transformers' defaults (length_penalty 1, early_stopping False): the best sequence must
be transformers' exactly; with n = 2 the two best, in order. The blocks the beams share
all come back afterwards, also when a small KV cache forces held beams to be preempted
and when the executor holding the beams dies mid-search.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from pagoda.v1 import generation_pb2 as pb
from tests.service.harness import chat_ids, collect, Service, one_torch_thread

CHATS = [
    "What is the capital of France?",
    "Answer with one word: what color is the sky on a clear day?",
    "Why is the sky blue?",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Is water wet? Answer yes or no.",
    "Translate 'good morning' to French.",
]
MAX_TOKENS = 20
WIDTH = 4
EOS = 2
PAD = 2  # transformers pads shorter returned sequences with it


@pytest.fixture(scope="module")
def reference(hf_reference):
    """content -> (prompt ids, transformers' 2 best beams, each cut at its own end, best first)."""
    model, tokenizer = hf_reference
    with one_torch_thread():
        out = {}
        for content in CHATS:
            prompt = chat_ids(tokenizer, content)
            with torch.inference_mode():
                rows = model.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    num_beams=WIDTH,
                    do_sample=False,
                    max_new_tokens=MAX_TOKENS,
                    num_return_sequences=2,
                )
            out[content] = (prompt, [_cut(row[len(prompt) :].tolist()) for row in rows])
        return out


def _cut(tokens: list[int]) -> list[int]:
    """A returned row up to its first EOS (transformers pads the shorter rows with EOS)."""
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def beam_request(prompt: list[int], n: int = 1, max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    req.token_ids.ids.extend(prompt)
    req.sampling.beam_width = WIDTH
    req.sampling.n = n
    req.stopping.max_tokens = max_tokens
    return req


def assert_best(result: dict, expected: list[list[int]], tokenizer) -> None:
    outputs = result["outputs"]
    assert sorted(outputs) == list(range(len(outputs)))
    for index, tokens in enumerate(expected[: len(outputs)]):
        out = outputs[index]
        assert out["token_ids"] == tokens, index
        assert out["text"] == tokenizer.decode(tokens, skip_special_tokens=True)
        ends_on_eos = tokens[-1] == EOS
        assert out["finish_reason"] == (pb.FINISH_REASON_EOS if ends_on_eos else pb.FINISH_REASON_LENGTH)
        assert ends_on_eos or len(tokens) == MAX_TOKENS
    # Nothing streams before the search ends: one message carries every sequence whole.
    assert len(result["messages"]) == 1
    assert result["last"].usage.completion_tokens == sum(len(o["token_ids"]) for o in outputs.values())


def assert_all_blocks_free(svc: Service) -> None:
    info = svc.wait_all_blocks_free()
    assert info.num_running == 0 and info.num_waiting == 0
    assert all(e.num_free_blocks == e.num_total_blocks for e in info.executors), info


@pytest.fixture(scope="module")
def service():
    with Service(scheduler_args=["--max-num-batched-tokens", "256"], executor_args=["--num-threads", "2"]) as svc:
        yield svc


def test_best_sequence_equals_transformers_beam_search(service, reference, hf_reference):
    _, tokenizer = hf_reference
    contents = CHATS[:6]

    def run(content):
        return collect(service.stub.Generate(beam_request(reference[content][0]), timeout=300))

    with ThreadPoolExecutor(len(contents)) as pool:  # several beam groups share the batch
        results = list(pool.map(run, contents))
    for content, result in zip(contents, results):
        prompt, expected = reference[content]
        assert result["first"].prompt_info.num_prompt_tokens == len(prompt)
        assert_best(result, expected[:1], tokenizer)
    assert any(reference[c][1][0][-1] == EOS for c in contents)  # some best beams end on EOS
    assert any(reference[c][1][0][-1] != EOS for c in contents)
    assert_all_blocks_free(service)


def test_n2_returns_the_two_best_in_order(service, reference, hf_reference):
    model, tokenizer = hf_reference
    content = CHATS[6]
    prompt, expected = reference[content]
    result = collect(service.stub.Generate(beam_request(prompt, n=2), timeout=300))
    assert_best(result, expected, tokenizer)
    sequences = [result["outputs"][i]["token_ids"] for i in (0, 1)]
    assert sequences[0] != sequences[1]
    scores = []
    with torch.inference_mode():
        for tokens in sequences:
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
            logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(tokens)[:, None])
            scores.append(logprobs.sum().item() / len(tokens))
    assert scores[0] >= scores[1]
    assert_all_blocks_free(service)


def test_logprobs_of_the_returned_beams(service, reference, hf_reference):
    model, _ = hf_reference
    prompt, expected = reference[CHATS[0]]
    req = beam_request(prompt, n=2)
    req.response.top_logprobs = 3
    result = collect(service.stub.Generate(req, timeout=300))
    for index in (0, 1):
        tokens = result["outputs"][index]["token_ids"]
        assert tokens == expected[index]
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        reference_logprobs = torch.log_softmax(logits.double(), dim=-1)
        entries = result["outputs"][index]["logprobs"]
        assert [e.token_id for e in entries] == tokens
        for i, entry in enumerate(entries):
            assert abs(entry.logprob - reference_logprobs[i, tokens[i]].item()) < 1e-4
            assert [t.token_id for t in entry.top] == reference_logprobs[i].topk(3).indices.tolist()


def test_cancelled_beam_search_frees_every_block(service, reference):
    call = service.stub.Generate(beam_request(reference[CHATS[4]][0], max_tokens=400), timeout=300)
    deadline = time.monotonic() + 60
    while not any(e.num_free_blocks < e.num_total_blocks for e in service.server_info().executors):
        assert time.monotonic() < deadline, "the beams never started"
        time.sleep(0.05)
    call.cancel()
    started = time.monotonic()
    assert_all_blocks_free(service)
    assert time.monotonic() - started < 5  # freed at once, not when a 400-token search would end


def test_beam_search_arguments_are_checked(service, reference):
    prompt = reference[CHATS[0]][0]
    cases = [
        ({"beam_width": 17}, "sampling.beam_width"),
        ({"beam_width": 2, "n": 3}, "sampling.n"),
        ({"beam_width": 2, "repetition_penalty": 1.2}, "sampling.repetition_penalty"),
    ]
    for fields, name in cases:
        req = pb.GenerateRequest()
        req.token_ids.ids.extend(prompt)
        for key, value in fields.items():
            setattr(req.sampling, key, value)
        with pytest.raises(grpc.RpcError) as info:
            collect(service.stub.Generate(req, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in info.value.details()
    req = beam_request(prompt)
    req.stopping.stop.append("Paris")
    with pytest.raises(grpc.RpcError) as info:
        collect(service.stub.Generate(req, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stopping.stop" in info.value.details()


def test_small_kv_cache_preempts_held_beams_and_still_finds_the_best(reference, hf_reference):
    _, tokenizer = hf_reference
    # 9 blocks of 16 (8 usable): one ~60-token beam takes 4, the group of 4 needs ~10.
    with Service(executor_args=["--num-kv-blocks", "9", "--num-threads", "2"]) as svc:
        for content in (CHATS[2], CHATS[4]):
            prompt, expected = reference[content]
            result = collect(svc.stub.Generate(beam_request(prompt), timeout=300))
            assert_best(result, expected[:1], tokenizer)
        assert svc.server_info().num_preemptions > 0
        assert_all_blocks_free(svc)


def test_beams_restart_on_a_survivor_when_their_executor_dies(reference, hf_reference):
    _, tokenizer = hf_reference
    prompt, expected = reference[CHATS[2]]
    with Service(
        scheduler_args=["--executor-timeout", "1.0"], executor_args=["--num-threads", "1"], num_executors=2
    ) as svc:
        call = svc.stub.Generate(beam_request(prompt), timeout=300)
        messages: list[pb.GenerateResponse] = []
        reader = threading.Thread(target=lambda: messages.extend(call), daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while True:  # kill whichever executor holds the beams, mid-search
            busy = [e for e in svc.server_info().executors if e.num_free_blocks < e.num_total_blocks]
            if busy or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert busy, "the beams never started"
        time.sleep(0.5)
        victim = next(p for p in svc.executors if f"-{p.pid}-" in busy[0].executor_id)
        victim.send_signal(signal.SIGKILL)
        assert not messages, "the search ended before the executor died"
        reader.join(300)
        assert not reader.is_alive()
        assert_best(collect(messages), expected[:1], tokenizer)
        info = svc.wait_all_blocks_free()
        assert [e.num_free_blocks == e.num_total_blocks for e in info.executors] == [True]


def test_without_async_scheduling_beams_and_n_samples_are_the_same(reference, hf_reference):
    """The representative subset with --no-async-scheduling: beam search (n = 2) and n = 3 seeded samples."""
    _, tokenizer = hf_reference
    prompt, expected = reference[CHATS[2]]
    with Service(scheduler_args=["--no-async-scheduling"], executor_args=["--num-threads", "2"]) as svc:
        assert_best(collect(svc.stub.Generate(beam_request(prompt, n=2), timeout=300)), expected, tokenizer)
        sampled = beam_request(prompt)
        sampled.sampling.beam_width = 1
        sampled.sampling.n, sampled.sampling.temperature, sampled.sampling.seed = 3, 0.8, 11
        without = collect(svc.stub.Generate(sampled, timeout=300))["outputs"]
        assert_all_blocks_free(svc)
    with Service(executor_args=["--num-threads", "2"]) as svc:  # async scheduling: the same draws
        with_async = collect(svc.stub.Generate(sampled, timeout=300))["outputs"]
    assert {i: o["token_ids"] for i, o in without.items()} == {i: o["token_ids"] for i, o in with_async.items()}
    assert len({tuple(o["token_ids"]) for o in without.values()}) > 1  # the samples differ from each other
