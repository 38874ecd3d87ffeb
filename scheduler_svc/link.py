"""The scheduler's end of the ZeroMQ link: one ROUTER socket that every executor connects to.

A thin adapter: it parses `ExecutorMessage`s and hands them to a `LinkListener`; it sends
`SchedulerMessage`s to an executor by identity.

Who is who. An executor's identity is its connection, never an id inside a message:

    routing id "<id>"     the executor's main DEALER: Hello, Register, StepResult, Goodbye
    routing id "<id>/hb"  its heartbeat DEALER: Heartbeat only

Every listener callback gets the executor id of the connection the message came on. A
message that names another executor (`executor_id` field), a non-heartbeat message on a
heartbeat connection, and a heartbeat without the token its executor registered are
dropped and logged. ROUTER refuses a second connection with a routing id already in use
(ROUTER_HANDOVER stays off), so a live executor's identity cannot be taken over.

With `LinkKeys` (a cluster secret) the socket is a CURVE server and a ZAP handler admits
only the client key derived from the same secret: a peer without it cannot complete the
handshake, so it is never handed a message, and its attempt is counted in
`pagoda:executor_link_rejected_connections_total`. Without keys the link is plaintext
(only with --insecure-executor-link: `pagoda.link_security.scheduler_link_keys`).

No message may be larger than `max_message_bytes` (ZMQ_MAXMSGSIZE, the largest an honest
executor sends: `scheduler_svc.result_check.max_executor_message_bytes`): ZeroMQ drops the
connection of a peer that sends more before the message is ever held in memory. The
executor then has to register again, as after any lost connection. ZMQ_MAXMSGSIZE bounds a
frame, not a message: an executor sends one frame a message, so a message of more frames is
read a frame at a time, thrown away, and its executor banned; and at most
`RECV_HIGH_WATER_MARK` frames wait per connection (ZeroMQ stops reading the peer's socket).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Protocol

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from pagoda import link_security, wire
from pagoda.link_security import LinkKeys
from pagoda.step import StepPlan
from pagoda.v1 import executor_pb2 as pb

log = logging.getLogger(__name__)

HEARTBEAT_SUFFIX = "/hb"
RECV_HIGH_WATER_MARK = 16
_HANDSHAKE_FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake",
}


class LinkListener(Protocol):
    """Callbacks get the executor id of the authenticated connection (see the module docstring)."""

    def on_hello(self, executor_id: str, msg: pb.Hello) -> None: ...
    def on_register(self, executor_id: str, msg: pb.Register) -> None: ...
    def on_heartbeat(self, executor_id: str, msg: pb.Heartbeat) -> None: ...
    def on_step_result(self, executor_id: str, msg: pb.StepResult) -> None: ...
    def on_goodbye(self, executor_id: str, msg: pb.Goodbye) -> None: ...


class _ExactKey:
    """ZAP credentials provider: admits one CURVE client public key (constant-time comparison)."""

    def __init__(self, client_public: bytes):
        self._key = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self._key)


class ExecutorLink:
    def __init__(
        self,
        bind: str,
        listener: LinkListener,
        keys: LinkKeys | None = None,
        registry: CollectorRegistry | None = None,
        max_message_bytes: int = -1,
    ):
        self._ctx = zmq.asyncio.Context()
        self._listener = listener
        self._auth: ThreadAuthenticator | None = None
        self._heartbeat_tokens: dict[str, bytes] = {}
        self._banned: set[str] = set()
        self.rejected = Counter(
            "pagoda:executor_link_rejected_connections",
            "Connections to the executor link that failed the handshake (no or wrong cluster secret, junk)",
            ["reason"],
            registry=registry,
        )
        self.dropped = Counter(
            "pagoda:executor_link_dropped_messages",
            "Executor messages dropped: unparsable, or naming another executor than their connection",
            ["reason"],
            registry=registry,
        )
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        # Frames queued per connection before ZeroMQ stops reading from it (TCP pushes back): an
        # executor has at most a Register or a StepResult or two in flight, its heartbeat
        # connection one beat. So a peer can make the scheduler hold at most this many frames
        # of at most max_message_bytes each, however many it sends.
        self._sock.setsockopt(zmq.RCVHWM, RECV_HIGH_WATER_MARK)
        if keys is not None:
            # The ZAP handler must be up before the socket binds: libzmq lets a CURVE client in
            # unchecked when no handler answers on inproc://zeromq.zap.01.
            self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger("scheduler_svc.zap"))
            self._auth.start()
            self._auth.configure_curve_callback(link_security.ZAP_DOMAIN, _ExactKey(keys.client_public))
            link_security.configure_server(self._sock, keys)
        self._monitor = self._sock.get_monitor_socket(sum(_HANDSHAKE_FAILURES))
        self._sock.bind(bind)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.secure = keys is not None

    async def serve(self) -> None:
        monitor = asyncio.ensure_future(self._watch_handshakes())
        try:
            while True:
                conn, payload, extra = await self._recv_bounded()
                if extra:
                    self._drop(conn, "extra_frames", f"a message of {1 + extra} frames (executors send one)")
                    self.ban(conn.removesuffix(HEARTBEAT_SUFFIX))
                    continue
                self._dispatch(conn, payload)
        finally:
            monitor.cancel()

    async def _recv_bounded(self) -> tuple[str, bytes, int]:
        """(connection, payload, number of frames past it), holding at most two frames at a time.

        `recv_multipart` would gather every frame of a message first: ZMQ_MAXMSGSIZE bounds each
        frame, not their number. Frames past the payload are read and thrown away one by one.
        """
        conn = (await self._sock.recv()).decode(errors="replace")
        payload, extra = b"", 0
        if self._sock.rcvmore:
            payload = await self._sock.recv()
        while self._sock.rcvmore:
            await self._sock.recv()
            extra += 1
        return conn, payload, extra

    def _dispatch(self, conn: str, payload: bytes) -> None:
        msg = pb.ExecutorMessage()
        try:
            msg.ParseFromString(payload)
        except Exception:
            self._drop(conn, "unparsable", "an unparsable message")
            return
        kind = msg.WhichOneof("kind")
        if kind is None:
            self._drop(conn, "unparsable", "a message of no known kind")
            return
        on_heartbeat_conn = conn.endswith(HEARTBEAT_SUFFIX)
        executor_id = conn[: -len(HEARTBEAT_SUFFIX)] if on_heartbeat_conn else conn
        if executor_id in self._banned:
            return
        body = getattr(msg, kind)
        claimed = getattr(body, "executor_id", executor_id)
        if claimed != executor_id:
            self._drop(conn, "wrong_executor_id", f"{kind} naming executor {claimed!r}")
            return
        if on_heartbeat_conn != (kind == "heartbeat"):
            self._drop(conn, "wrong_connection", f"{kind} on the wrong connection")
            return
        if kind == "heartbeat":
            expected = self._heartbeat_tokens.get(executor_id)
            if expected is not None and not hmac.compare_digest(expected, body.token):
                self._drop(conn, "wrong_heartbeat_token", "a heartbeat without its executor's token")
                return
            self._listener.on_heartbeat(executor_id, body)
        elif kind == "step_result":
            self._listener.on_step_result(executor_id, body)
        elif kind == "hello":
            self._listener.on_hello(executor_id, body)
        elif kind == "register":
            self._heartbeat_tokens[executor_id] = body.heartbeat_token
            self._listener.on_register(executor_id, body)
        elif kind == "goodbye":
            self._listener.on_goodbye(executor_id, body)
        elif kind == "lora_status":
            self._listener.on_lora_status(executor_id, body)

    def _drop(self, conn: str, reason: str, what: str) -> None:
        self.dropped.labels(reason).inc()
        log.warning("dropping %s from connection %r", what, conn)

    async def _watch_handshakes(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            reason = _HANDSHAKE_FAILURES.get(event["event"])
            if reason is not None:
                self.rejected.labels(reason).inc()
                log.warning("executor link: a peer failed the %s handshake (%s): %s", "CURVE" if self.secure else "ZMTP", reason, event["value"])

    def ban(self, executor_id: str) -> None:
        """Ignore every further message of `executor_id` (it broke the protocol; it is not trusted again)."""
        self._banned.add(executor_id)

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

    def close(self, linger_s: float = 0.0) -> None:
        """`linger_s`: how long queued messages (a last notice to every executor) may take to leave."""
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(linger=int(linger_s * 1000))
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
