"""A tensor-parallel group fails as a whole (issue #15): real `python -m executor_svc` ranks, no scheduler.

Rank 0 waits for a scheduler that never answers, so the ranks sit in their set-up, watched by
their watchdogs: the death of rank 0 (ranks started one by one, as on several hosts: no
parent-death signal) ends rank 1; a hung rank 1 (SIGSTOP) ends rank 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.service.harness import ROOT, free_port


def start_rank(model_dir, log_path, *args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "executor_svc", "--model", str(model_dir), "--device", "cpu", "--num-threads", "1",
           "--tensor-parallel-size", "2", "--scheduler", f"tcp://127.0.0.1:{free_port()}", "--tp-watchdog-timeout", "3", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def wait_for_text(path, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert time.monotonic() < deadline, path.read_text()
        time.sleep(0.2)


def test_death_of_rank0_ends_the_other_ranks(tiny_model_dirs, tmp_path):
    port = str(free_port())
    flags = ["--tp-master-addr", "127.0.0.1", "--tp-master-port", port]
    rank0 = start_rank(tiny_model_dirs["llama"], tmp_path / "rank0.log", *flags, "--tp-rank", "0")
    rank1 = start_rank(tiny_model_dirs["llama"], tmp_path / "rank1.log", *flags, "--tp-rank", "1")
    try:
        wait_for_text(tmp_path / "rank1.log", "rank 1 of 2 (gloo) joined")
        wait_for_text(tmp_path / "rank0.log", "waiting for the scheduler")
        rank0.kill()
        assert rank1.wait(timeout=60) != 0
        assert "unreachable" in (tmp_path / "rank1.log").read_text()
    finally:
        for proc in (rank0, rank1):
            proc.kill()
            proc.wait()


def test_hung_rank_ends_the_group(tiny_model_dirs, tmp_path):
    log = tmp_path / "group.log"
    rank0 = start_rank(tiny_model_dirs["llama"], log)  # starts rank 1 itself
    try:
        wait_for_text(log, "waiting for the scheduler")
        wait_for_text(log, "rank 1 of 2 (gloo) joined")
        (child,) = [int(p) for p in open(f"/proc/{rank0.pid}/task/{rank0.pid}/children").read().split()]
        os.kill(child, signal.SIGSTOP)
        assert rank0.wait(timeout=60) != 0
        assert "rank 1 silent" in log.read_text()
    finally:
        rank0.kill()
        rank0.wait()


def test_sigterm_before_any_scheduler_stops_the_group_cleanly(tiny_model_dirs, tmp_path):
    """Rank 0 gives up its handshake on SIGTERM and tells rank 1 to leave: no rank reports a failure."""
    log = tmp_path / "group.log"
    rank0 = start_rank(tiny_model_dirs["llama"], log)
    try:
        wait_for_text(log, "waiting for the scheduler")
        wait_for_text(log, "rank 1 of 2 (gloo) joined")
        (child,) = [int(p) for p in open(f"/proc/{rank0.pid}/task/{rank0.pid}/children").read().split()]
        rank0.send_signal(signal.SIGTERM)
        assert rank0.wait(timeout=60) == 0  # stopped on request (no scheduler ever answered)
        assert not os.path.exists(f"/proc/{child}") or "zombie" in open(f"/proc/{child}/status").read()
        assert "group broken" not in log.read_text()
    finally:
        rank0.kill()
        rank0.wait()
