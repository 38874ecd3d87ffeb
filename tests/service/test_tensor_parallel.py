"""A tensor-parallel executor group (issue #15) beside a plain executor, under one scheduler.

The real processes: `python -m executor_svc --tensor-parallel-size 2` (rank 0 starts rank 1,
gloo over 127.0.0.1) and `python -m executor_svc`, on a tiny random Llama saved as a Hugging
Face folder. Both serve, token for token as transformers; SIGKILL of rank 1 takes the whole
group down (rank 0 exits too), and every stream it held resumes on the other executor,
still token for token as transformers.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.service.harness import Service, collect, greedy_request, hf_greedy, one_torch_thread
from tests.service.test_failover import Stream, info_of
from tests.service.test_tiny_models import build_tiny

PROMPTS = [[1, 520 + i * 7, 33, 1200 + i, 9, 17 + i] * (1 + i % 3) for i in range(6)]
SHORT, LONG = 16, 160


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, default_model_dir):
    """(folder, {prompt index: transformers' greedy ids for LONG tokens}) computed before any service runs."""
    path = tmp_path_factory.mktemp("tp-tiny-llama")
    reference = build_tiny("llama", path, default_model_dir, shard=True)
    with one_torch_thread():
        return path, {i: hf_greedy(reference, p, LONG, ignore_eos=True) for i, p in enumerate(PROMPTS)}


def rank_pids(rank0_pid: int) -> list[int]:
    """The ranks rank 0 started (its child processes)."""
    text = open(f"/proc/{rank0_pid}/task/{rank0_pid}/children").read()
    return [int(pid) for pid in text.split()]


def test_tp_group_and_single_executor_serve_and_group_fails_as_a_whole(tiny_llama):
    model_dir, expected = tiny_llama
    with Service(
        model=str(model_dir),
        scheduler_args=["--executor-timeout", "1.0"],
        executor_args=["--num-threads", "1", "--num-kv-blocks", "256"],
        num_executors=0,
    ) as svc:
        group = svc.add_executor(["--tensor-parallel-size", "2"])
        svc.add_executor()
        svc.wait_serving(2)
        group_id = next(e.executor_id for e in svc.server_info().executors if f"-{group.pid}-" in e.executor_id)
        assert len(rank_pids(group.pid)) == 1  # rank 1, started by rank 0

        # Both serve: short greedy requests spread over both executors, equal to transformers.
        served_by_group = False
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [
                pool.submit(lambda p=p: collect(svc.stub.Generate(greedy_request(prompt_ids=p, max_tokens=SHORT, ignore_eos=True), timeout=300)))
                for p in PROMPTS
            ]
            while not all(f.done() for f in futures):
                served_by_group |= any(e.executor_id == group_id and e.num_running for e in svc.server_info().executors)
                time.sleep(0.05)
        for i, future in enumerate(futures):
            assert future.result()["outputs"][0]["token_ids"] == expected[i][:SHORT], i
        assert served_by_group

        # SIGKILL rank 1 while the group holds streams: the group leaves, its streams resume.
        streams = [
            Stream(svc.stub, f"p{i}", request=greedy_request(prompt_ids=p, max_tokens=LONG, ignore_eos=True))
            for i, p in enumerate(PROMPTS)
        ]
        deadline = time.monotonic() + 120
        while not any(e.executor_id == group_id and e.num_running for e in svc.server_info().executors):
            assert time.monotonic() < deadline, svc.logs()
            time.sleep(0.02)
        for stream in streams:
            stream.wait_tokens(4)
        (rank1,) = rank_pids(group.pid)
        os.kill(rank1, signal.SIGKILL)
        assert group.wait(timeout=60) != 0  # rank 0 left with its group
        for i, stream in enumerate(streams):  # nothing lost, nothing repeated
            assert stream.result()["outputs"][0]["token_ids"] == expected[i], (i, svc.logs())
        info = info_of(svc, group)
        assert info is None or not info.healthy
        assert "tensor-parallel group broken" in svc.logs(tail=100_000)


def test_ranks_started_one_by_one_with_rendezvous_flags(tiny_llama):
    """The several-hosts way, here on one host: each rank its own process with --tp-rank and the
    rendezvous address; only rank 0 talks to the scheduler. SIGTERM on rank 0 drains the group:
    rank 1 leaves cleanly too."""
    from tests.service.harness import free_port

    model_dir, expected = tiny_llama
    port = str(free_port())
    rendezvous = ["--tensor-parallel-size", "2", "--tp-master-addr", "127.0.0.1", "--tp-master-port", port]
    with Service(model=str(model_dir), executor_args=["--num-threads", "1", "--num-kv-blocks", "64"], num_executors=0) as svc:
        rank1 = svc.add_executor([*rendezvous, "--tp-rank", "1", "--scheduler", "tcp://127.0.0.1:1"])  # never used
        rank0 = svc.add_executor([*rendezvous, "--tp-rank", "0"])
        svc.wait_serving(1)
        assert len(svc.server_info().executors) == 1
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(
                lambda p: collect(svc.stub.Generate(greedy_request(prompt_ids=p, max_tokens=SHORT, ignore_eos=True), timeout=300)), PROMPTS
            ))
        for i, result in enumerate(results):
            assert result["outputs"][0]["token_ids"] == expected[i][:SHORT], i
        rank0.send_signal(signal.SIGTERM)
        assert rank0.wait(timeout=60) == 0
        assert rank1.wait(timeout=60) == 0, svc.logs()
