"""The scheduler's end of the ZeroMQ link: one ROUTER socket that every executor connects to.

A thin adapter: it parses `ExecutorMessage`s and hands them to a `LinkListener`; it sends
`SchedulerMessage`s to an executor by identity. An executor's main DEALER socket has the
identity of its executor_id; its heartbeat socket has another one, so the scheduler
always answers on the main identity named in the message.
"""

from __future__ import annotations

import logging
from typing import Protocol

import zmq
import zmq.asyncio

from pagoda import wire
from pagoda.step import StepPlan
from pagoda.v1 import executor_pb2 as pb

log = logging.getLogger(__name__)


class LinkListener(Protocol):
    def on_hello(self, msg: pb.Hello) -> None: ...
    def on_register(self, msg: pb.Register) -> None: ...
    def on_heartbeat(self, msg: pb.Heartbeat) -> None: ...
    def on_step_result(self, executor_id: str, msg: pb.StepResult) -> None: ...
    def on_goodbye(self, msg: pb.Goodbye) -> None: ...


class ExecutorLink:
    def __init__(self, bind: str, listener: LinkListener):
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(bind)
        self._listener = listener
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def serve(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            identity, payload = frames[0], frames[-1]
            msg = pb.ExecutorMessage()
            try:
                msg.ParseFromString(payload)
            except Exception:
                log.warning("dropping an unparsable message from %r", identity)
                continue
            kind = msg.WhichOneof("kind")
            if kind == "step_result":
                self._listener.on_step_result(identity.decode(errors="replace"), msg.step_result)
            elif kind == "heartbeat":
                self._listener.on_heartbeat(msg.heartbeat)
            elif kind == "hello":
                self._listener.on_hello(msg.hello)
            elif kind == "register":
                self._listener.on_register(msg.register)
            elif kind == "goodbye":
                self._listener.on_goodbye(msg.goodbye)

    async def send_plan(self, executor_id: str, plan: StepPlan) -> bool:
        return await self.send(executor_id, pb.SchedulerMessage(step_plan=wire.plan_to_proto(plan)))

    async def send(self, executor_id: str, msg: pb.SchedulerMessage) -> bool:
        """False when the executor is not connected (ZeroMQ cannot route to it)."""
        try:
            await self._sock.send_multipart([executor_id.encode(), msg.SerializeToString()])
            return True
        except zmq.ZMQError as exc:
            log.warning("cannot reach executor %s: %s", executor_id, exc)
            return False

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()
