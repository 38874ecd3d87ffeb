"""Runs `python -m gateway_svc` as its own process for the tests."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx

from tests.service.harness import ROOT, free_port


class Gateway:
    def __init__(self, target: str, extra_args=()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--port", str(self.port), "--target", target, *extra_args]
        self.log = Path(tempfile.mkdtemp(prefix="pagoda-gw-")) / "gateway.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Gateway:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway_svc", *self.args], cwd=ROOT, env=env,
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/metrics", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise TimeoutError(f"gateway not up:\n{self.log.read_text()}")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
