"""Overload (issue #16): the bounded queue sheds with RESOURCE_EXHAUSTED, admitted streams keep
their pace, and a request whose client deadline passes while it waits never uses compute."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.service.harness import Service, collect, frozen_client_heap, greedy_request
from tests.service.test_tiny_models import build_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp("tiny-overload")
    build_tiny("llama", path, default_model_dir, shard=False)
    return path


def _gaps(svc, prompt, max_tokens) -> list[float]:
    times = [time.monotonic() for _ in svc.stub.Generate(greedy_request(prompt_ids=prompt, max_tokens=max_tokens, ignore_eos=True), timeout=120)]
    return [b - a for a, b in zip(times, times[1:])]


def _status(svc, req, timeout=120) -> grpc.StatusCode:
    try:
        collect(svc.stub.Generate(req, timeout=timeout))
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def test_a_flood_is_shed_and_the_admitted_stream_keeps_its_pace(tiny_dir):
    args = ["--max-waiting-requests", "4", "--max-num-seqs", "2"]
    with Service(model=str(tiny_dir), scheduler_args=args, executor_args=["--num-kv-blocks", "256"]) as svc, frozen_client_heap():
        baseline = max(_gaps(svc, [1, 50, 51], 120))
        statuses: list[grpc.StatusCode] = []
        waiting_seen: list[int] = []

        def flood():
            with ThreadPoolExecutor(16) as pool:
                reqs = [greedy_request(prompt_ids=[1, 60 + i, 61], max_tokens=40, ignore_eos=True) for i in range(48)]
                statuses.extend(pool.map(lambda r: _status(svc, r), reqs))

        def watch():
            while thread.is_alive():
                waiting_seen.append(svc.server_info().num_waiting)
                time.sleep(0.05)

        thread = threading.Thread(target=flood)
        thread.start()
        watcher = threading.Thread(target=watch)
        watcher.start()
        loaded = max(_gaps(svc, [1, 50, 51], 120))
        thread.join()
        watcher.join()
        assert set(statuses) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, statuses
        assert max(waiting_seen) <= 4 + 1  # the bound (+ the measured stream, which may wait its turn)
        assert loaded <= max(2 * baseline, 0.25), (loaded, baseline)  # the floor: a shared 2-core machine
        info = svc.wait_all_blocks_free()
        assert all(e.num_free_blocks == e.num_total_blocks for e in info.executors)


def test_a_request_whose_deadline_passes_while_waiting_is_never_computed(tiny_dir):
    with Service(model=str(tiny_dir), scheduler_args=["--max-num-seqs", "1"], executor_args=["--num-kv-blocks", "256"]) as svc:
        long_running = threading.Thread(target=lambda: _gaps(svc, [1, 70, 71], 900))
        long_running.start()
        time.sleep(0.5)
        waiting_prompt = [1] + list(range(3000, 3063))  # 4 full blocks: cached if it were ever computed
        code = _status(svc, greedy_request(prompt_ids=waiting_prompt, max_tokens=4), timeout=0.5)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert long_running.is_alive(), "the running request should still hold the only seat"
        deadline = time.monotonic() + 5
        while svc.server_info().num_waiting and time.monotonic() < deadline:
            time.sleep(0.05)
        assert svc.server_info().num_waiting == 0  # dropped from the queue
        long_running.join()
        again = collect(svc.stub.Generate(greedy_request(prompt_ids=waiting_prompt, max_tokens=4), timeout=60))
        assert again["first"].prompt_info.num_cached_tokens == 0  # its prompt was never prefilled
