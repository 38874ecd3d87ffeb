"""KV memory through the real service: preemption, prefix caching, n samples sharing blocks."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagoda.v1 import generation_pb2 as pb
from tests.service.harness import Service, chat_ids, collect, greedy_request, one_torch_thread

SYSTEM = (
    "You are Pagoda's test assistant. Answer briefly and precisely. Prefer short sentences. "
    "Never invent facts; say so when you do not know. Use metric units. Dates are ISO 8601. "
    "When asked for code, answer in Python with type hints and no comments. "
    "When asked for a list, give at most three items. Keep a friendly, professional tone."
)


@pytest.fixture(scope="module")
def preemption_case(default_greedy, default_tokenizer):
    """12 prompts of ~100 tokens and transformers' 96 greedy tokens for each, computed before the
    service starts (and cached: tests/references.py)."""
    topics = ["rivers", "mountains", "volcanoes", "deserts", "forests", "glaciers", "oceans", "islands",
              "caves", "lakes", "canyons", "reefs"]
    prompts = [
        chat_ids(default_tokenizer, [{"role": "user", "content": f"Tell me about {t}. " + "Be detailed, thorough and precise in every answer. " * 8}])
        for t in topics
    ]
    with one_torch_thread():
        return [(p, default_greedy.greedy(p, 96, ignore_eos=True)) for p in prompts]


@pytest.mark.timeout(900, func_only=True)  # the service's part only: the reference is the fixture's
def test_preemption_keeps_every_greedy_output(preemption_case):
    """48 KV blocks (752 token slots) for 12 requests of ~100 + 96 tokens: preemption must happen."""
    prompts = [p for p, _ in preemption_case]
    assert all(90 <= len(p) <= 130 for p in prompts), [len(p) for p in prompts]
    with Service(executor_args=["--num-kv-blocks", "48"], scheduler_args=["--max-num-batched-tokens", "256"]) as svc:
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(
                    lambda p: collect(svc.stub.Generate(greedy_request(prompt_ids=p, max_tokens=96, ignore_eos=True), timeout=900)),
                    prompts,
                )
            )
        info = svc.wait_all_blocks_free()
        assert info.num_preemptions > 0
        assert info.executors[0].num_total_blocks == 47
        assert info.executors[0].num_free_blocks == 47
    for (prompt, expected), result in zip(preemption_case, results):
        tokens = result["outputs"][0]["token_ids"]
        assert len(tokens) == 96
        assert tokens == expected


@pytest.fixture(scope="module")
def service():
    with Service(scheduler_args=["--max-num-batched-tokens", "512"]) as svc:
        yield svc


def test_shared_system_prompt_hits_the_prefix_cache(service, default_greedy, default_tokenizer):
    tokenizer = default_tokenizer
    questions = ["What is 2 + 2?", "Name a primary color.", "What is the boiling point of water?", "Say hello."]
    prompts = [chat_ids(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in questions]
    first = collect(service.stub.Generate(greedy_request(prompt_ids=prompts[0], max_tokens=8), timeout=120))
    assert first["first"].prompt_info.num_cached_tokens == 0
    for prompt in prompts[1:]:
        common = next(i for i, (a, b) in enumerate(zip(prompt, prompts[0])) if a != b)
        result = collect(service.stub.Generate(greedy_request(prompt_ids=prompt, max_tokens=8), timeout=120))
        assert common > 64
        assert result["first"].prompt_info.num_cached_tokens == (common // 16) * 16
        assert result["last"].usage.cached_prompt_tokens == (common // 16) * 16
        assert result["outputs"][0]["token_ids"] == default_greedy.greedy(prompt, 8)
    info = service.wait_all_blocks_free()
    assert info.executors[0].num_cached_blocks > 0
    assert info.executors[0].num_free_blocks == info.executors[0].num_total_blocks


def _sampled_request(prompt, n, seed, max_tokens):
    req = pb.GenerateRequest()
    req.token_ids.ids.extend(prompt)
    req.sampling.temperature = 1.0
    req.sampling.n = n
    req.sampling.seed = seed
    req.stopping.max_tokens = max_tokens
    req.stopping.ignore_eos = True
    return req


def test_n_samples_share_the_prompt_blocks_and_replay_with_the_seed(service, default_tokenizer):
    tokenizer = default_tokenizer
    prompt = chat_ids(tokenizer, [{"role": "system", "content": SYSTEM * 2}, {"role": "user", "content": "Write a short poem about tea."}])
    prompt_blocks = -(-len(prompt) // 16)
    assert prompt_blocks >= 10
    peak_in_use = []
    running_seen = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            info = service.server_info()
            e = info.executors[0]
            if e.num_running == 4:
                running_seen.append(True)
                peak_in_use.append(e.num_total_blocks - e.num_free_blocks)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        first = collect(service.stub.Generate(_sampled_request(prompt, 4, 1234, 48), timeout=300))
    finally:
        done.set()
        watcher.join()
    outputs = first["outputs"]
    assert sorted(outputs) == [0, 1, 2, 3]
    assert all(len(o["token_ids"]) == 48 for o in outputs.values())
    assert len({tuple(o["token_ids"]) for o in outputs.values()}) > 1  # different seeds, different samples
    assert first["last"].usage.completion_tokens == 4 * 48
    # Four samples running at once hold the prompt's blocks once: far fewer than 4 copies.
    assert running_seen
    assert max(peak_in_use) < prompt_blocks + 4 * (48 // 16 + 2)
    assert max(peak_in_use) < 2 * prompt_blocks

    again = collect(service.stub.Generate(_sampled_request(prompt, 4, 1234, 48), timeout=300))
    assert {i: o["token_ids"] for i, o in again["outputs"].items()} == {i: o["token_ids"] for i, o in outputs.items()}
    info = service.wait_all_blocks_free()
    assert info.executors[0].num_free_blocks == info.executors[0].num_total_blocks
