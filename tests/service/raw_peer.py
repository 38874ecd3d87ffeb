"""A hand-driven ZeroMQ peer of the executor link, for tests that play an intruder or a liar."""

from __future__ import annotations

import zmq

from pagoda import link_security
from pagoda.link_security import LinkKeys
from pagoda.v1 import executor_pb2 as pb


class RawPeer:
    """A DEALER with routing id `identity`; `keys` as an executor would use them, or `curve` = (server key, own pair)."""

    def __init__(self, endpoint: str, identity: str, keys: LinkKeys | None = None, curve: tuple[bytes, bytes, bytes] | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            link_security.configure_client(self.sock, keys)
        elif curve is not None:
            self.sock.curve_serverkey, self.sock.curve_publickey, self.sock.curve_secretkey = curve
        self.sock.connect(endpoint)

    def send(self, **kind) -> None:
        self.send_raw(pb.ExecutorMessage(**kind).SerializeToString())

    def send_raw(self, payload: bytes) -> None:
        """Queue `payload`; a DEALER with no completed handshake keeps it (it never leaves) instead of blocking."""
        try:
            self.sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            pass

    def recv(self, timeout_s: float) -> pb.SchedulerMessage | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        msg = pb.SchedulerMessage()
        msg.ParseFromString(self.sock.recv())
        return msg

    def recv_all(self, timeout_s: float) -> list[pb.SchedulerMessage]:
        out = []
        msg = self.recv(timeout_s)
        while msg is not None:
            out.append(msg)
            msg = self.recv(0.1)
        return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
