"""Service helpers of the client tests: a scheduler that can be killed and started again."""

from __future__ import annotations

import subprocess

from tests.service.harness import Service

EXECUTOR_ARGS = ["--num-threads", "1", "--num-kv-blocks", "256"]


def target(svc: Service) -> str:
    return f"127.0.0.1:{svc.port}"


def kill_scheduler(svc: Service) -> None:
    """SIGKILL: no drain, no goodbye; the executors keep running and reconnect later."""
    svc.scheduler.kill()
    svc.scheduler.wait()


def start_scheduler_again(svc: Service) -> subprocess.Popen:
    """The same scheduler command on the same ports (its executors re-register by heartbeat)."""
    args = ["--port", str(svc.port), "--executor-bind", svc.zmq, "--metrics-port", str(svc.metrics_port),
            *svc.scheduler_args]
    svc.scheduler = svc._spawn("scheduler_svc", args, "scheduler-again")
    return svc.scheduler
