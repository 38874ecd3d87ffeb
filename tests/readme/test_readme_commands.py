"""README.md's shell commands, run as written in this checkout, against one `make run` (issue #25).

Each ```bash block of the README is preceded by an HTML comment `<!-- readme-test: KIND -->`:

    serves           its `make run` line is started, waited for (grpc.health SERVING), used by the
                     blocks below, and stopped as a user does, with Ctrl-C (SIGINT to its process
                     group); its `make test*` lines are this suite itself
    client           every line runs against that service and must exit 0 with some output
    serves-gateway   its first line (the gateway) is started against the service, the other lines
                     run against the gateway, then Ctrl-C
    docker, gpu, kubernetes, manual
                     not run here (make compose-test, make gpu-check, tests/deploy, by hand)

Only the ports change: other runs on the machine may hold the defaults, so every command gets free
ones through the PAGODA_* variables it reads, and `127.0.0.1:50051` / port 8000 written in a
command are replaced by them. The first Python example (streaming a chat) runs too.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.service.harness import ROOT, free_port

pytestmark = pytest.mark.timeout(1200)

KINDS = {"serves", "client", "serves-gateway", "docker", "gpu", "kubernetes", "manual"}
BLOCK = re.compile(r"<!-- readme-test: ([^>]*?) -->\n```bash\n(.*?)```", re.S)


def blocks() -> list[tuple[set[str], list[str]]]:
    text = (ROOT / "README.md").read_text()
    return [({k.strip() for k in re.sub(r"\(.*\)", "", kinds).split(",")},
             [line for line in body.splitlines() if line.strip()])
            for kinds, body in BLOCK.findall(text)]


def lines_of(kind: str) -> list[str]:
    return [line for kinds, lines in blocks() if kind in kinds for line in lines]


def test_every_shell_block_says_how_it_is_tested():
    text = (ROOT / "README.md").read_text()
    assert text.count("```bash\n") == len(blocks()), "a ```bash block without <!-- readme-test: KIND -->"
    for kinds, _ in blocks():
        assert kinds <= KINDS, kinds


def local(command: str, ports: dict[str, int]) -> str:
    return (command.replace("127.0.0.1:50051", f"127.0.0.1:{ports['grpc']}")
            .replace("--port 8000", f"--port {ports['gateway']}"))


def start(command: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def ctrl_c(proc: subprocess.Popen, timeout: float = 60) -> str:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        left = subprocess.run(["ps", "-o", "pid,stat,etime,args", "-g", str(proc.pid)], capture_output=True, text=True,
                              check=False).stdout  # which of the group's processes did not stop
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"still running {timeout:g} s after Ctrl-C:\n{left}\n{out[-3000:]}")
    return out


def wait_serving(target: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service="pagoda.v1.Generation"), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(1)
    pytest.fail("make run did not serve in time")


@pytest.fixture(scope="module")
def service():
    """The README's `make run`, on free ports."""
    (run,) = [line for line in lines_of("serves") if line.startswith("make run")]
    ports = {"grpc": free_port(), "link": free_port(), "gateway": free_port()}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
    env.update(PAGODA_PORT=str(ports["grpc"]), PAGODA_EXECUTOR_BIND=f"tcp://127.0.0.1:{ports['link']}",
               PAGODA_SCHEDULER=f"tcp://127.0.0.1:{ports['link']}", PAGODA_METRICS_PORT="0")
    proc = start(run, env)
    try:
        wait_serving(f"127.0.0.1:{ports['grpc']}", proc)
        yield ports, {**{k: v for k, v in env.items() if k not in ("PAGODA_PORT",)},
                      "PAGODA_TARGET": f"127.0.0.1:{ports['grpc']}"}
    finally:
        out = ctrl_c(proc) if proc.poll() is None else proc.communicate()[0]
    assert proc.returncode is not None and "Traceback" not in out, out[-3000:]


def run(command: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, input="Name a color.\n/exit\n",
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("command", lines_of("client"))
def test_client_command_runs_as_written(service, command):
    ports, env = service
    done = run(local(command, ports), env)
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert done.stdout.strip(), command


def test_the_python_example_streams_an_answer(service):
    ports, env = service
    text = (ROOT / "README.md").read_text()
    example = text.split("```python\n", 1)[1].split("```", 1)[0]
    done = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", local(example, ports)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Paris" in done.stdout, done.stdout + done.stderr


def test_the_gateway_commands_run_as_written(service):
    ports, env = service
    gateway, *clients = lines_of("serves-gateway")
    proc = start(local(gateway, ports), env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{ports['gateway']}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        client_env = {**env, "PAGODA_GATEWAY_URL": f"http://127.0.0.1:{ports['gateway']}/v1"}
        for command in clients:
            done = run(local(command, ports), client_env)
            assert done.returncode == 0 and done.stdout.strip(), f"{command}\n{done.stdout}\n{done.stderr}"
    finally:
        out = ctrl_c(proc)
    assert "Traceback" not in out, out[-3000:]
