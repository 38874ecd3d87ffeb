"""Where and how the client connects: addresses, API key, TLS, retry policy.

The API key travels as call metadata `authorization: Bearer <key>` (what the scheduler's
`--api-key` checks); TLS uses grpc's SSL channel credentials, with a client certificate for
mutual TLS (the scheduler's `--ssl-ca-certs`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

DEFAULT_TARGET = "127.0.0.1:50051"

# Messages of a long prompt's tokens or top logprobs can pass grpc's 4 MiB default.
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def parse_targets(targets: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """`"a:1,b:2"`, a list, or None (then `PAGODA_TARGET`, else 127.0.0.1:50051)."""
    if targets is None:
        targets = os.environ.get("PAGODA_TARGET") or DEFAULT_TARGET
    if isinstance(targets, str):
        targets = targets.split(",")
    out = tuple(t.strip() for t in targets if t.strip())
    if not out:
        raise ValueError("targets: at least one host:port is required")
    return out


@dataclass(frozen=True)
class TLSConfig:
    """Server verification by `root_certificates` (None: the system roots); `certificate_chain`
    and `private_key` present a client certificate (mutual TLS). `server_name` overrides the
    name checked against the server's certificate (e.g. when dialing by IP)."""

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None

    @classmethod
    def from_files(cls, ca: str | None = None, cert: str | None = None, key: str | None = None,
                   server_name: str | None = None) -> TLSConfig:
        if bool(cert) != bool(key):
            raise ValueError("tls: a client certificate needs both cert and key")
        read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
        return cls(read(ca), read(cert), read(key), server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


@dataclass(frozen=True)
class RetryPolicy:
    """UNAVAILABLE is retried on the next address: before the first token always, after it by
    resuming the stream (see `resume.py`). `max_attempts` counts every try of one call; the
    wait before a retry starts at `initial_backoff` and doubles up to `max_backoff`, except
    that the first try of each other address in a round goes at once."""

    max_attempts: int = 10  # one address: about 40 s of retries, enough for a scheduler restart
    initial_backoff: float = 0.25
    max_backoff: float = 8.0

    def backoff(self, attempt: int, num_targets: int) -> float:
        """Seconds to wait before try number `attempt` (1 = the first retry)."""
        if attempt % num_targets:
            return 0.0
        rounds = attempt // num_targets
        return min(self.initial_backoff * 2 ** (rounds - 1), self.max_backoff)


@dataclass(frozen=True)
class Connection:
    targets: tuple[str, ...]
    api_key: str | None = None
    tls: TLSConfig | None = None

    def metadata(self, api_key: str | None = None) -> tuple[tuple[str, str], ...]:
        key = api_key or self.api_key
        return (("authorization", f"Bearer {key}"),) if key else ()

    def _options(self) -> list[tuple[str, object]]:
        options = list(_CHANNEL_OPTIONS)
        if self.tls and self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return options

    def channel(self, target: str) -> grpc.Channel:
        if self.tls:
            return grpc.secure_channel(target, self.tls.credentials(), options=self._options())
        return grpc.insecure_channel(target, options=self._options())

    def aio_channel(self, target: str) -> grpc.aio.Channel:
        if self.tls:
            return grpc.aio.secure_channel(target, self.tls.credentials(), options=self._options())
        return grpc.aio.insecure_channel(target, options=self._options())
