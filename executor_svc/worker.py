"""The executor's end of the ZeroMQ link: handshake, step loop, heartbeats, drain.

    executor                         scheduler
       │ Hello ────────────────────────▶ │
       │ ◀──────────────── ExecutorConfig │   block size, budget, model fingerprint
       │   (size the KV cache)            │
       │ Register ─────────────────────▶ │
       │ ◀──────────────────── Registered │   (or Shutdown: wrong model)
       │ ◀── StepPlan / StepResult ──▶    │   one step at a time
       │ Heartbeat (own socket, thread) ▶ │   every heartbeat_interval_s
       │ Goodbye ──────────────────────▶ │   on SIGTERM: the scheduler moves our requests

An unsolicited ExecutorConfig means the scheduler no longer knows us (it restarted, or
declared us dead after a stall): drop every request's state and register anew.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Callable

import zmq

from pagoda import link_security, wire
from pagoda.link_security import LinkKeys
from pagoda.v1 import executor_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    scheduler: str = "tcp://127.0.0.1:5557"
    executor_id: str = ""
    heartbeat_interval_s: float = 0.5
    handshake_timeout_s: float = 600.0
    link_keys: LinkKeys | None = None  # CURVE keys from the cluster secret; None: plaintext link

    def resolved_id(self) -> str:
        return self.executor_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    """Runs `runner_factory(config_msg)` once the scheduler has said which block size to use."""

    def __init__(self, config: WorkerConfig, runner_factory: Callable[[pb.ExecutorConfig], object], fingerprint: str):
        self.config = config
        self.executor_id = config.resolved_id()
        self._runner_factory = runner_factory
        self._fingerprint = fingerprint
        self._runner = None
        self._ctx = zmq.Context()
        # Our heartbeats carry this, so that no other peer can keep our registration alive.
        self._heartbeat_token = secrets.token_bytes(16)
        self._sock = self._link_socket(self.executor_id, linger_ms=1000)
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._last_step_id = 0

    # ---- public ---------------------------------------------------------------------------
    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._draining.set())
        config = self._handshake_config()
        if config is None:
            return 1
        self._runner = self._runner_factory(config)
        if not self._register(config):
            return 1
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        heartbeat.start()
        try:
            return self._serve()
        finally:
            self._stop.set()
            heartbeat.join(timeout=2)
            self._sock.close(linger=1000)
            self._ctx.term()

    def _link_socket(self, identity: str, linger_ms: int, sndhwm: int | None = None) -> zmq.Socket:
        """A DEALER to the scheduler with routing id `identity` (the scheduler knows us by it), CURVE when keyed.

        Every option is set before connect: ZeroMQ applies HWMs and keys to connections made after.
        """
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.LINGER, linger_ms)
        if sndhwm is not None:
            sock.setsockopt(zmq.SNDHWM, sndhwm)
        link_security.configure_client(sock, self.config.link_keys)
        sock.connect(self.config.scheduler)
        return sock

    # ---- handshake -------------------------------------------------------------------------
    def _send(self, **kind) -> None:
        self._sock.send(pb.ExecutorMessage(**kind).SerializeToString())

    def _recv(self, timeout_s: float) -> pb.SchedulerMessage | None:
        if not self._sock.poll(int(timeout_s * 1000)):
            return None
        msg = pb.SchedulerMessage()
        msg.ParseFromString(self._sock.recv())
        return msg

    def _handshake_config(self) -> pb.ExecutorConfig | None:
        deadline = time.monotonic() + self.config.handshake_timeout_s
        while time.monotonic() < deadline and not self._draining.is_set():
            self._send(hello=pb.Hello(executor_id=self.executor_id))
            msg = self._recv(2.0)
            if msg is None:
                log.info("waiting for the scheduler at %s", self.config.scheduler)
                continue
            if msg.WhichOneof("kind") == "config":
                return msg.config
            if msg.WhichOneof("kind") == "shutdown":
                log.error("scheduler refused us: %s", msg.shutdown.reason)
                return None
        log.error("no answer from the scheduler at %s", self.config.scheduler)
        return None

    def _register(self, config: pb.ExecutorConfig) -> bool:
        runner = self._runner
        if config.model_fingerprint and config.model_fingerprint != self._fingerprint:
            log.error("scheduler serves model %s, we hold %s", config.model_fingerprint, self._fingerprint)
            return False
        if config.block_size != runner.block_size:
            log.error("scheduler wants block size %d, our cache has %d", config.block_size, runner.block_size)
            return False
        self._send(
            register=pb.Register(
                executor_id=self.executor_id,
                model_fingerprint=self._fingerprint,
                block_size=runner.block_size,
                num_kv_blocks=runner.num_kv_blocks,
                device=runner.device,
                max_model_len=runner.max_model_len,
                vocab_size=runner.vocab_size,
                heartbeat_token=self._heartbeat_token,
                weight_bytes=runner.weight_bytes,
            )
        )
        while not self._draining.is_set():
            msg = self._recv(5.0)
            if msg is None:
                continue
            kind = msg.WhichOneof("kind")
            if kind == "registered":
                log.info("registered %s: %s, %d KV blocks", self.executor_id, runner.device, runner.num_kv_blocks)
                return True
            if kind == "shutdown":
                log.error("scheduler refused us: %s", msg.shutdown.reason)
                return False
        return False

    # ---- steady state ----------------------------------------------------------------------
    def _serve(self) -> int:
        while True:
            if self._draining.is_set():
                log.info("stopping: handing our requests back to the scheduler")
                self._send(goodbye=pb.Goodbye(executor_id=self.executor_id, reason="stopping"))
                return 0
            msg = self._recv(0.2)
            if msg is None:
                continue
            kind = msg.WhichOneof("kind")
            if kind == "step_plan":
                self._send(step_result=self._execute(msg.step_plan))
            elif kind == "config":
                log.warning("the scheduler no longer knows us: dropping all requests, registering again")
                self._runner.reset()
                if not self._register(msg.config):
                    return 1
            elif kind == "shutdown":
                log.info("scheduler asked us to stop: %s", msg.shutdown.reason)
                return 0

    def _execute(self, plan_msg: pb.StepPlan) -> pb.StepResult:
        self._last_step_id = plan_msg.step_id
        try:
            result = self._runner.execute(wire.plan_from_proto(plan_msg))
            return wire.result_to_proto(result)
        except Exception:
            log.exception("step %d failed", plan_msg.step_id)
            self._runner.reset()
            return pb.StepResult(step_id=plan_msg.step_id, error=traceback.format_exc(limit=5))

    def _heartbeat_loop(self) -> None:
        sock = self._link_socket(f"{self.executor_id}/hb", linger_ms=0, sndhwm=4)
        try:
            while not self._stop.wait(self.config.heartbeat_interval_s):
                beat = pb.Heartbeat(executor_id=self.executor_id, last_step_id=self._last_step_id, token=self._heartbeat_token)
                try:
                    sock.send(pb.ExecutorMessage(heartbeat=beat).SerializeToString(), zmq.NOBLOCK)
                except zmq.Again:
                    pass
        finally:
            sock.close(0)
