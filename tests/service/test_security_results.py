"""The scheduler checks every step result (issues #13, #24): an executor that lies is dropped.

A lying executor (tests/service/lying_executor.py: the real model, then corrupted results)
serves alone until it lies; its requests, with the tokens accepted so far, wait for an
honest executor and finish there exactly as transformers' greedy continuation.
"""

from __future__ import annotations

import re
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


@pytest.mark.parametrize("lie", ["out_of_range", "unscheduled", "top_logprobs"])
def test_an_executor_returning_bad_tokens_is_dropped_and_its_requests_finish_elsewhere(lie, reference):
    scheduler_args = ["--executor-timeout", "2", "--no-executor-wait", "300"]
    with Service(num_executors=0, scheduler_args=scheduler_args, executor_args=["--num-threads", "1"]) as svc:
        liar = svc.add_executor(module="tests.service.lying_executor", module_args=["--lie", lie, "--lie-after", "4"])
        svc.wait_serving(1)
        (liar_info,) = svc.server_info().executors
        def request(content):
            req = greedy_request(chat=[("user", content)], max_tokens=MAX_TOKENS)
            req.response.top_logprobs = 2
            return req

        with ThreadPoolExecutor(len(CHATS)) as pool:
            calls = {c: pool.submit(lambda c=c: collect(svc.stub.Generate(request(c), timeout=300))) for c in CHATS}
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
            assert all(len(lp.top) == 2 for lp in out["logprobs"])  # what was asked, from the honest executor
            assert result["last"].usage.completion_tokens == len(reference[content])
        assert liar_info.executor_id not in [e.executor_id for e in svc.server_info().executors]
        log = (svc.logdir / "scheduler.log").read_text()
        expected = {  # an extra token is refused on the count, before its request id is looked at
            "out_of_range": "outside the vocabulary",
            "unscheduled": r"token for unscheduled request|3 tokens and 0 errors for 2 scheduled requests",
            "top_logprobs": "200000 top logprobs for '.*', which asked for 2",
        }[lie]
        assert re.search(expected, log), log[-3000:]
