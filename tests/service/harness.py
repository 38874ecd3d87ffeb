"""Starts the real services (scheduler + executors, separate processes) for end-to-end tests."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.v1 import generation_pb2 as pb
from pagoda.v1 import generation_pb2_grpc as pb_grpc
from tests.references import hf_greedy  # noqa: F401  (re-exported: the tests' one computation)

ROOT = Path(__file__).resolve().parents[2]
SERVICE = "pagoda.v1.Generation"


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (all held open while picked, so none is returned twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """`with Service(...) as svc:` runs `python -m scheduler_svc` and N `python -m executor_svc`."""

    def __init__(
        self, model: str | None = None, scheduler_args=(), executor_args=(), num_executors: int = 1,
        channel_credentials: grpc.ChannelCredentials | None = None, api_key: str | None = None,
    ):
        """`channel_credentials`: the stub's channel is TLS (for --ssl-*); `api_key`: the stub sends it (--api-key)."""
        self.model = model
        self.channel_credentials = channel_credentials
        self.api_key = api_key
        self.scheduler_args = list(scheduler_args)
        self.executor_args = list(executor_args)
        self.num_executors = num_executors
        self.port, zmq_port, self.metrics_port = free_ports(3)  # distinct: free_port() twice may repeat
        self.zmq = f"tcp://127.0.0.1:{zmq_port}"
        self.logdir = Path(tempfile.mkdtemp(prefix="pagoda-svc-"))
        self.scheduler: subprocess.Popen | None = None
        self.executors: list[subprocess.Popen] = []
        self.channel: grpc.Channel | None = None

    def _spawn(self, module: str, args: list[str], name: str) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        log = open(self.logdir / f"{name}.log", "w")
        model = ["--model", self.model] if self.model else []
        return subprocess.Popen(
            [sys.executable, "-m", module, *model, *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )

    def _spawn_scheduler(self, name: str = "scheduler") -> subprocess.Popen:
        args = ["--port", str(self.port), "--executor-bind", self.zmq, "--metrics-port", str(self.metrics_port)]
        return self._spawn("scheduler_svc", [*args, *self.scheduler_args], name)

    def restart_scheduler(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
        """Stop the scheduler with `sig`, then start a new one on the same ports; executors stay."""
        self.scheduler.send_signal(sig)
        self.scheduler.wait(timeout)
        self.num_scheduler_restarts = getattr(self, "num_scheduler_restarts", 0) + 1
        self.scheduler = self._spawn_scheduler(f"scheduler{self.num_scheduler_restarts}")

    def start(self) -> "Service":
        self.scheduler = self._spawn_scheduler()
        for _ in range(self.num_executors):
            self.add_executor()
        self.channel = self.open_channel(self.channel_credentials, self.api_key)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        if self.num_executors:
            self.wait_serving(self.num_executors)
        return self

    def open_channel(self, credentials: grpc.ChannelCredentials | None = None, api_key: str | None = None) -> grpc.Channel:
        """A channel to the scheduler: TLS with `credentials`, sending `api_key` on every call when given."""
        target = f"127.0.0.1:{self.port}"
        if credentials is None:
            channel = grpc.insecure_channel(target)
            return grpc.intercept_channel(channel, BearerKey(api_key)) if api_key else channel
        if api_key:
            credentials = grpc.composite_channel_credentials(credentials, grpc.access_token_call_credentials(api_key))
        return grpc.secure_channel(target, credentials)

    def stub_for(self, api_key: str | None) -> pb_grpc.GenerationStub:
        """A stub on a new connection of its own, sending `api_key` (None: no key), TLS as the service's stub."""
        return pb_grpc.GenerationStub(self.open_channel(self.channel_credentials, api_key))

    def add_executor(self, extra_args=(), module: str = "executor_svc", module_args=()) -> subprocess.Popen:
        """Start an executor; `module` (with `module_args` before the flags) may be a test double of executor_svc."""
        args = [*module_args, "--scheduler", self.zmq, "--device", "cpu", *self.executor_args, *extra_args]
        proc = self._spawn(module, args, f"executor{len(self.executors)}")
        self.executors.append(proc)
        return proc

    def wait_serving(self, num_executors: int = 1, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                status = self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    healthy = [e for e in self.server_info().executors if e.healthy]
                    if len(healthy) >= num_executors:
                        return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"service not serving {num_executors} executors in {timeout} s\n{self.logs()}")

    def _check_alive(self) -> None:
        if self.scheduler.poll() is not None:
            raise RuntimeError(f"scheduler exited with {self.scheduler.returncode}\n{self.logs()}")

    def server_info(self) -> pb.ServerInfo:
        return self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)

    def wait_all_blocks_free(self, timeout: float = 20.0) -> pb.ServerInfo:
        deadline = time.monotonic() + timeout
        while True:
            info = self.server_info()
            if info.num_running == 0 and info.num_waiting == 0 and all(
                e.num_free_blocks == e.num_total_blocks for e in info.executors
            ):
                return info
            if time.monotonic() > deadline:
                return info
            time.sleep(0.1)

    def logs(self, tail: int = 4000) -> str:
        out = []
        for path in sorted(self.logdir.glob("*.log")):
            out.append(f"--- {path.name} ---\n{path.read_text()[-tail:]}")
        return "\n".join(out)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        procs = [p for p in [*self.executors, self.scheduler] if p is not None]
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> "Service":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


class BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <key>` to every call of a plaintext channel (call credentials need TLS)."""

    def __init__(self, key: str):
        self._metadata = ("authorization", f"Bearer {key}")

    def _details(self, details):
        return details._replace(metadata=[*(details.metadata or ()), self._metadata])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


def collect(responses) -> dict:
    """Join a Generate stream: per index the token ids, text, finish reason; plus first/last messages."""
    outputs: dict[int, dict] = {}
    messages = list(responses)
    for message in messages:
        for out in message.outputs:
            o = outputs.setdefault(out.index, {"token_ids": [], "text": "", "finish_reason": 0, "logprobs": [], "matched_stop": ""})
            o["token_ids"].extend(out.token_ids)
            o["text"] += out.text
            o["logprobs"].extend(out.logprobs)
            if out.finish_reason:
                o["finish_reason"] = out.finish_reason
            if out.matched_stop:
                o["matched_stop"] = out.matched_stop
    return {"outputs": outputs, "first": messages[0], "last": messages[-1], "messages": messages}


def greedy_request(prompt_ids=None, chat=None, text=None, max_tokens=32, request_id="", **stopping) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id)
    if prompt_ids is not None:
        req.token_ids.ids.extend(prompt_ids)
    elif chat is not None:
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in chat)
    else:
        req.text = text
    req.sampling.temperature = 0.0
    req.stopping.max_tokens = max_tokens
    for key, value in stopping.items():
        setattr(req.stopping, key, value)
    return req


def chat_ids(tokenizer, content: str | list[dict]) -> list[int]:
    """Prompt ids of a chat (one user message, or a list of messages) with the model's template."""
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@contextlib.contextmanager
def one_torch_thread():
    """Reference generations on one thread: on shared cores, several threads are several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def frozen_client_heap():
    """Keep this test process's own full garbage collections out of a timed window.

    The test process is a client here, but by the service tests it holds ~500,000 objects
    (526k after tests/core, unit and executor), and a full collection of them took 0.24 s on
    this 2-core machine: an inter-token gap the service never made, in a test that bounds the
    largest gap. Frozen objects are skipped; what the window makes is still collected.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
