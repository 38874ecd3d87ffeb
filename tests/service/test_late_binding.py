"""The engine redesign (issue #12): late binding to executors, and scheduling with and without a step ahead.

Real processes, greedy streams compared with transformers token for token.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.service.harness import Service, chat_ids, collect, greedy_request, one_torch_thread
from tests.service.test_failover import EXECUTOR_ARGS, assert_idle, info_of, wait_until

SCALE_OUT_TOPICS = [
    "rivers", "mountains", "volcanoes", "deserts", "forests", "glaciers",
    "oceans", "islands", "caves", "lakes", "canyons", "reefs",
]
SCALE_OUT_TOKENS = 160


@pytest.fixture(scope="module")
def scale_out_reference(default_greedy, default_tokenizer):
    tokenizer = default_tokenizer
    prompts = [chat_ids(tokenizer, f"Write a long essay about {topic}.") for topic in SCALE_OUT_TOPICS]
    with one_torch_thread():
        return [(p, default_greedy.greedy(p, SCALE_OUT_TOKENS, ignore_eos=True)) for p in prompts]


@pytest.mark.timeout(900, func_only=True)  # the reference (1,920 tokens one by one) is the fixture's
def test_an_executor_added_under_load_takes_queued_work(scale_out_reference):
    """One executor with --max-num-seqs 4 and 36 requests of 160 tokens at once (the 12 prompts three
    times: queued work must outlast a newcomer's ~16 s start even where 4 streams of 160 tokens take
    only 5 s); a second executor joins 2 s later. Bound on arrival, the 32 waiting requests stayed on
    the first executor; bound late, the newcomer starts queued requests within seconds of registering."""
    with Service(scheduler_args=["--max-num-seqs", "4"], executor_args=EXECUTOR_ARGS) as svc:
        first = svc.executors[0]
        work = scale_out_reference * 3
        with ThreadPoolExecutor(len(work)) as pool:
            futures = [
                pool.submit(
                    lambda p: collect(svc.stub.Generate(
                        greedy_request(prompt_ids=p, max_tokens=SCALE_OUT_TOKENS, ignore_eos=True), timeout=900)),
                    prompt,
                )
                for prompt, _ in work
            ]
            wait_until(lambda: info_of(svc, first).num_running == 4, 60, "the first executor is full")
            info = wait_until(lambda: (i := svc.server_info()).num_waiting == len(work) - 4 and i, 30, "all queued")
            assert info.executors[0].num_waiting == 0, info  # queued in the engine, not on the executor
            time.sleep(2)
            newcomer = svc.add_executor()
            svc.wait_serving(2)
            registered = time.monotonic()
            busy = wait_until(lambda: info_of(svc, newcomer).num_running > 0 and info_of(svc, newcomer), 30,
                              "the newcomer runs queued requests")
            took = time.monotonic() - registered
            assert busy.num_running == 4 and took < 10, (busy, took)
            assert info_of(svc, first).num_running == 4  # both full while work is queued
            results = [f.result() for f in futures]
        for (prompt, expected), result in zip(work, results, strict=True):
            assert result["outputs"][0]["token_ids"] == expected
        assert_idle(svc, 2)
        log = (svc.logdir / "scheduler.log").read_text()
        assert not re.search(r"Traceback|ERROR", log), log[-3000:]


@pytest.mark.parametrize("async_flag", ["--async-scheduling", "--no-async-scheduling"])
def test_preemption_prefix_hits_and_chunks_with_and_without_a_step_ahead(async_flag, default_greedy, default_tokenizer):
    """A small KV cache (preemption), a 64-token budget (chunked prefill), a shared prompt (prefix
    hits): greedy outputs equal transformers' either way."""
    tokenizer = default_tokenizer
    system = "You are a careful assistant. Answer in full sentences and explain every step of your reasoning."
    prompts = [
        chat_ids(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": f"Describe {t}."}])
        for t in ("a river", "a mountain", "a volcano", "a desert", "a forest", "a glacier")
    ]
    with one_torch_thread():
        expected = [default_greedy.greedy(p, 40, ignore_eos=True) for p in prompts]
    with Service(
        scheduler_args=[async_flag, "--max-num-batched-tokens", "64"],
        executor_args=["--num-kv-blocks", "24", "--num-threads", "2"],
    ) as svc:
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(
                lambda p: collect(svc.stub.Generate(greedy_request(prompt_ids=p, max_tokens=40, ignore_eos=True), timeout=600)),
                prompts,
            ))
        info = svc.wait_all_blocks_free()
        assert info.num_preemptions > 0, info
        assert info.executors[0].num_free_blocks == info.executors[0].num_total_blocks
    for want, result in zip(expected, results):
        assert result["outputs"][0]["token_ids"] == want
    assert sum(r["first"].prompt_info.num_cached_tokens for r in results) > 0  # the shared prompt hit
