"""The scheduler checks every step result (issue #13): an executor that lies is dropped.

A lying executor (tests/service/lying_executor.py: the real model, then corrupted results)
serves alone until it lies; its requests, with the tokens accepted so far, wait for an
honest executor and finish there exactly as transformers' greedy continuation.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.service.harness import Service, chat_ids, collect, greedy_request, hf_greedy, one_torch_thread

CHATS = ["Write a haiku about the sea.", "How do I boil an egg?"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def reference(hf_reference):
    model, tokenizer = hf_reference
    with one_torch_thread():
        return {c: hf_greedy(model, chat_ids(tokenizer, c), MAX_TOKENS) for c in CHATS}


@pytest.mark.parametrize("lie", ["out_of_range", "unscheduled"])
def test_an_executor_returning_bad_tokens_is_dropped_and_its_requests_finish_elsewhere(lie, reference):
    scheduler_args = ["--executor-timeout", "2", "--no-executor-wait", "300"]
    with Service(num_executors=0, scheduler_args=scheduler_args, executor_args=["--num-threads", "1"]) as svc:
        liar = svc.add_executor(module="tests.service.lying_executor", module_args=["--lie", lie, "--lie-after", "4"])
        svc.wait_serving(1)
        (liar_info,) = svc.server_info().executors
        with ThreadPoolExecutor(len(CHATS)) as pool:
            calls = {
                c: pool.submit(lambda c=c: collect(svc.stub.Generate(greedy_request(chat=[("user", c)], max_tokens=MAX_TOKENS), timeout=300)))
                for c in CHATS
            }
            deadline = time.monotonic() + 120
            while "invalid step result" not in (svc.logdir / "scheduler.log").read_text():
                assert time.monotonic() < deadline, svc.logs()
                time.sleep(0.2)
            assert liar.wait(timeout=30) == 0  # told to shut down
            svc.add_executor()
            results = {c: call.result(timeout=300) for c, call in calls.items()}
        for content, result in results.items():
            out = result["outputs"][0]
            assert out["token_ids"] == reference[content], content
            assert result["last"].usage.completion_tokens == len(reference[content])
        assert liar_info.executor_id not in [e.executor_id for e in svc.server_info().executors]
        log = (svc.logdir / "scheduler.log").read_text()
        expected = "outside the vocabulary" if lie == "out_of_range" else "token for unscheduled request"
        assert expected in log, log[-3000:]
