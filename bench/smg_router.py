"""Runs SMG, the field's router (`smg launch --backend vllm`, the `smg` package), in front of
Pagoda schedulers, for the router tests (tests/router) and bench/bench_router.py.

    with SmgRouter([f"grpc://127.0.0.1:{port}" for port in ports]) as router:
        httpx.post(f"{router.url}/v1/completions", json={...})

It binds 127.0.0.1 (the router's own default is every address), its metrics port too, and
waits until every worker is healthy in the router's view (GET /workers) and the router has
registered the tokenizer of every worker's model (GET /v1/tokenizers): it loads tokenizers in a
background job after a worker turns ready, and until then answers 503 "not registered yet".
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.service.harness import free_ports

# Deterministic routing for tests and benchmarks: no warm-up slice that sends one cache miss in
# four (and one hit in eight) to a worker with a thin cache, whatever the prefixes say.
DETERMINISTIC_ROUTING = ["--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0"]


class SmgRouter:
    def __init__(self, worker_urls: list[str], extra_args=(), startup_timeout: float = 120.0):
        self.worker_urls = list(worker_urls)
        self.port, self.prometheus_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            "launch", "--backend", "vllm", "--worker-urls", *self.worker_urls,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
            *extra_args,
        ]
        self.startup_timeout = startup_timeout
        self.log = Path(tempfile.mkdtemp(prefix="pagoda-smg-")) / "smg.log"
        self.proc: subprocess.Popen | None = None

    def workers(self) -> list[dict]:
        """The router's view of its workers (GET /workers): health, labels, pushed load."""
        with urllib.request.urlopen(f"{self.url}/workers", timeout=5) as reply:
            return json.loads(reply.read())["workers"]

    def tokenizers(self) -> set[str]:
        """Names of the models whose tokenizer the router has registered (GET /v1/tokenizers)."""
        with urllib.request.urlopen(f"{self.url}/v1/tokenizers", timeout=5) as reply:
            return {t["name"] for t in json.loads(reply.read())["tokenizers"]}

    def ready(self) -> bool:
        healthy = [w for w in self.workers() if w.get("is_healthy") and w.get("status") == "ready"]
        if len(healthy) < len(self.worker_urls):
            return False
        return {w["model_id"] for w in healthy} <= self.tokenizers()

    def worker(self, port: int) -> dict:
        (found,) = [w for w in self.workers() if w["url"].endswith(f":{port}")]
        return found

    def __enter__(self) -> SmgRouter:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "smg", *self.args], stdout=open(self.log, "w"), stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited {self.proc.returncode}:\n{self.logs()}")
            try:
                if self.ready():
                    return self
            except OSError:
                pass
            time.sleep(0.3)
        self.__exit__()
        raise TimeoutError(f"smg did not see {len(self.worker_urls)} healthy workers and their tokenizers:\n{self.logs()}")

    def logs(self, tail: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-tail:] if self.log.exists() else ""

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
