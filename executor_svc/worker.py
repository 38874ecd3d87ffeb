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
       │ ◀─────────────── SchedulerStopping │   the scheduler stops: wait for the next one

The process outlives its scheduler: weights and KV cache are loaded once, and each time
the scheduler goes away the worker drops every request's state and waits for one to come
back (up to handshake_timeout_s), then registers again. It learns that the scheduler is
gone from a SchedulerStopping notice (SIGTERM), or from ZeroMQ itself: ZMTP heartbeats
(PING/PONG, answered by the scheduler's ZeroMQ I/O thread) drop a connection whose peer is
dead or unreachable, and a socket monitor reports the disconnection. An unsolicited
ExecutorConfig means the scheduler no longer knows us (it restarted, or declared us dead
after a stall): the same, at once. A Shutdown (a scheduler that refuses us: wrong model,
wrong block size) ends the process.

Both sockets set ZMQ_IMMEDIATE: nothing queues for a scheduler that is not connected, so a
new scheduler never receives the Hellos, heartbeats or results meant for an old one.
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
from zmq.utils.monitor import recv_monitor_message

from pagoda import link_security, wire
from pagoda.gc_heap import freeze_startup_heap
from pagoda.link_security import LinkKeys
from pagoda.step import MAX_ERROR_MESSAGE_CHARS
from pagoda.v1 import executor_pb2 as pb

log = logging.getLogger(__name__)


class SchedulerLost(Exception):
    """The link to the scheduler dropped (ZeroMQ's heartbeat timed out, or the peer closed)."""


@dataclass(frozen=True)
class WorkerConfig:
    scheduler: str = "tcp://127.0.0.1:5557"
    executor_id: str = ""
    heartbeat_interval_s: float = 0.5
    handshake_timeout_s: float = 600.0  # how long to wait for a scheduler, at start and after losing one
    link_timeout_s: float = 3.0  # ZMTP heartbeat: a scheduler silent this long is gone
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
        self._sock = self._link_socket(self.executor_id, linger_ms=1000, link_timeout_s=config.link_timeout_s)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._stop = threading.Event()
        # Set by SIGTERM / SIGINT. A plain attribute, not a threading.Event: a handler runs between
        # two bytecodes of the main thread, also inside another handler (a terminal's Ctrl-C
        # reaches us and `scripts/run.sh`, whose trap then sends SIGTERM), and Event.set takes a
        # lock that the interrupted handler may hold: the process hung for good, deaf to signals.
        self._drain_signalled = False

    # ---- public ---------------------------------------------------------------------------
    def run(self) -> int:
        self.install_signal_handlers()
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        try:
            config = self._handshake_config()
            if config is None:
                return 0 if self._drain_signalled else 1
            self._runner = self._runner_factory(config)
            self._apply_lora_config(config)
            freeze_startup_heap("executor")
            heartbeat.start()
            while True:
                if not self._register(config):
                    return 0 if self._drain_signalled else 1
                outcome = self._serve()
                if isinstance(outcome, int):
                    return outcome
                self._runner.reset()  # the scheduler is gone or forgot us; weights and cache stay
                config = outcome if outcome is not None else self._handshake_config()
                if config is None:
                    return 0 if self._drain_signalled else 1
                self._apply_lora_config(config)
        finally:
            self._stop.set()
            if heartbeat.is_alive():
                heartbeat.join(timeout=2)
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(linger=1000)
            self._ctx.term()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT drain: requests go back to the scheduler, then the process ends."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop_signal)

    def _on_stop_signal(self, signum, frame) -> None:
        self._drain_signalled = True  # no lock, no I/O: see __init__

    def _pause(self, seconds: float) -> None:
        """Sleep `seconds`, less once a stop signal came."""
        deadline = time.monotonic() + seconds
        while not self._drain_signalled and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))

    def _link_socket(
        self, identity: str, linger_ms: int, sndhwm: int | None = None, link_timeout_s: float | None = None
    ) -> zmq.Socket:
        """A DEALER to the scheduler with routing id `identity` (the scheduler knows us by it), CURVE when keyed.

        Every option is set before connect: ZeroMQ applies HWMs and keys to connections made after.
        ZMQ_IMMEDIATE: nothing queues for a scheduler that is not connected (no stale Hellos,
        beats or results for the next one); `link_timeout_s`: ZMTP heartbeats drop a dead peer.
        """
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        if link_timeout_s is not None:
            sock.setsockopt(zmq.HEARTBEAT_IVL, int(link_timeout_s * 1000 / 3))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(link_timeout_s * 1000))
        if sndhwm is not None:
            sock.setsockopt(zmq.SNDHWM, sndhwm)
        link_security.configure_client(sock, self.config.link_keys)
        sock.connect(self.config.scheduler)
        return sock

    # ---- handshake -------------------------------------------------------------------------
    def _send(self, **kind) -> bool:
        """False when no scheduler is connected (ZMQ_IMMEDIATE: the message is dropped)."""
        try:
            self._sock.send(pb.ExecutorMessage(**kind).SerializeToString(), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _recv(self, timeout_s: float) -> pb.SchedulerMessage | None:
        """The next message, or None after `timeout_s`; raises SchedulerLost if the link dropped."""
        events = dict(self._poller.poll(int(timeout_s * 1000)))
        if self._monitor in events:
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                raise SchedulerLost("the connection to the scheduler dropped")
        if self._sock not in events:
            return None
        msg = pb.SchedulerMessage()
        msg.ParseFromString(self._sock.recv())
        return msg

    def _handshake_config(self) -> pb.ExecutorConfig | None:
        deadline = time.monotonic() + self.config.handshake_timeout_s
        while time.monotonic() < deadline and not self._drain_signalled:
            if not self._send(hello=pb.Hello(executor_id=self.executor_id)):
                log.info("waiting for the scheduler at %s", self.config.scheduler)
                self._pause(1.0)
                continue
            try:
                msg = self._recv(2.0)
            except SchedulerLost:
                continue
            if msg is None:
                continue
            if msg.WhichOneof("kind") == "config":
                return msg.config
            if msg.WhichOneof("kind") == "shutdown":
                log.error("scheduler refused us: %s", msg.shutdown.reason)
                return None
        if not self._drain_signalled:
            log.error("no answer from the scheduler at %s in %g s", self.config.scheduler, self.config.handshake_timeout_s)
        return None

    def _register(self, config: pb.ExecutorConfig) -> bool:
        """Register; False if we cannot serve this scheduler (or are stopping). A lost link tries again."""
        runner = self._runner
        if config.model_fingerprint and config.model_fingerprint != self._fingerprint:
            log.error("scheduler serves model %s, we hold %s", config.model_fingerprint, self._fingerprint)
            return False
        if config.block_size != runner.block_size:
            log.error("scheduler wants block size %d, our cache has %d", config.block_size, runner.block_size)
            return False
        register = self._register_message()
        while not self._drain_signalled:
            if not self._send(register=register):  # not connected: the scheduler checks a Register itself
                self._pause(0.5)
                continue
            deadline = time.monotonic() + 5.0
            try:
                while time.monotonic() < deadline and not self._drain_signalled:
                    msg = self._recv(0.5)
                    kind = msg.WhichOneof("kind") if msg is not None else None
                    if kind == "registered":
                        log.info("registered %s: %s, %d KV blocks", self.executor_id, runner.device, runner.num_kv_blocks)
                        return True
                    if kind == "shutdown":
                        log.error("scheduler refused us: %s", msg.shutdown.reason)
                        return False
            except SchedulerLost:
                log.warning("lost the scheduler while registering")
        return False

    def _register_message(self) -> pb.Register:
        """What we announce: a pooling runner (`executor_svc.pooling`) holds no KV cache and
        registers the least the scheduler takes (2 blocks: the null block and one)."""
        runner = self._runner
        return pb.Register(
            executor_id=self.executor_id,
            model_fingerprint=self._fingerprint,
            block_size=runner.block_size,
            num_kv_blocks=runner.num_kv_blocks,
            device=runner.device,
            vocab_size=runner.vocab_size,
            heartbeat_token=self._heartbeat_token,
            weight_bytes=runner.weight_bytes,
            kv_cache_groups=wire.kv_cache_groups_to_proto(runner.kv_cache_groups),
            runner=getattr(runner, "runner", "generate"),
            whole_image_chunks=bool(getattr(getattr(runner, "config", None), "image_bidirectional", False)),
        )

    # ---- steady state ----------------------------------------------------------------------
    def _serve(self) -> int | pb.ExecutorConfig | None:
        """Serve steps. Returns an exit status, a config to register with, or None: the scheduler is gone."""
        while True:
            if self._drain_signalled:
                log.info("stopping: handing our requests back to the scheduler")
                self._send(goodbye=pb.Goodbye(executor_id=self.executor_id, reason="stopping"))
                return 0
            try:
                msg = self._recv(0.2)
            except SchedulerLost as exc:
                # A scheduler that stops sends SchedulerStopping and then closes; ZMQ_IMMEDIATE drops
                # what was not read yet when the connection goes, so the notice can be lost to the
                # drop. Either way the same follows.
                log.warning("%s: dropping all requests, waiting for the next one (weights and cache kept)", exc)
                return None
            if msg is None:
                continue
            kind = msg.WhichOneof("kind")
            if kind == "step_plan":
                self._send(step_result=self._execute(msg.step_plan))
            elif kind == "config":
                log.warning("the scheduler no longer knows us: dropping all requests, registering again")
                return msg.config
            elif kind == "stopping":
                log.info(
                    "the scheduler is stopping (%s): dropping all requests, waiting for the next one (weights and cache kept)",
                    msg.stopping.reason,
                )
                return None
            elif kind == "shutdown":
                log.info("scheduler asked us to stop: %s", msg.shutdown.reason)
                return 0
            elif kind in ("load_lora", "unload_lora"):
                self._send(lora_status=self._lora(msg))

    def _apply_lora_config(self, config: pb.ExecutorConfig) -> None:
        """A scheduler's LoRA settings: adapters on (none loaded yet: it sends its own) or off."""
        if config.enable_lora:
            try:
                self._runner.enable_lora(config.max_lora_rank or 64)
            except ValueError as exc:  # (tensor parallelism): its adapters' requests fail here, never run on the base
                log.error("LoRA adapters cannot run here: %s", exc)
        if getattr(self._runner, "loras", None) is not None:
            self._runner.loras.clear()

    def _lora(self, msg: pb.SchedulerMessage) -> pb.LoraStatus:
        """Load or unload an adapter as the scheduler says; its status (an error names the field)."""
        from pagoda.lora_files import LoraError

        load = msg.WhichOneof("kind") == "load_lora"
        name = msg.load_lora.name if load else msg.unload_lora.name
        try:
            if load:
                self._runner.add_lora_files(name, msg.load_lora.config_json, msg.load_lora.weights)
            else:
                self._runner.remove_lora(name)
        except LoraError as exc:
            log.error("LoRA adapter %r: %s", name, exc)
            return pb.LoraStatus(name=name, error=str(exc)[:MAX_ERROR_MESSAGE_CHARS])
        return pb.LoraStatus(name=name)

    def _execute(self, plan_msg: pb.StepPlan) -> pb.StepResult:
        """The step's result; error messages cut to what the scheduler accepts (it bounds a message's size)."""
        try:
            if getattr(self._runner, "runner", "generate") == "pooling":
                result = self._runner.execute_proto(plan_msg)  # StepPlan.pool_requests -> StepResult.pooled
            else:
                result = wire.result_to_proto(self._runner.execute(wire.plan_from_proto(plan_msg)))
            for error in result.errors:
                error.message = error.message[:MAX_ERROR_MESSAGE_CHARS]
            return result
        except Exception:
            log.exception("step %d failed", plan_msg.step_id)
            self._runner.reset()
            return pb.StepResult(step_id=plan_msg.step_id, error=traceback.format_exc(limit=5)[-MAX_ERROR_MESSAGE_CHARS:])

    def _heartbeat_loop(self) -> None:
        sock = self._link_socket(f"{self.executor_id}/hb", linger_ms=0, sndhwm=4)
        try:
            while not self._stop.wait(self.config.heartbeat_interval_s):
                beat = pb.Heartbeat(executor_id=self.executor_id, token=self._heartbeat_token)
                try:
                    sock.send(pb.ExecutorMessage(heartbeat=beat).SerializeToString(), zmq.NOBLOCK)
                except zmq.Again:
                    pass
        finally:
            sock.close(0)
