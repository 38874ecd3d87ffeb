"""What every OpenAI request passes before a route sees it: the caller's key, then a bounded body.

`Admission` is a raw ASGI middleware on every path but /health and /metrics:

1. the `Authorization` header must be ASCII, and its key (or, with none, the gateway's own
   `--api-key`) one the scheduler takes: asked with GetModelInfo and remembered for a few
   seconds (`KeyVerdicts`). A key the scheduler refuses is answered 401 before one byte of the
   body is read, so a caller without a key costs the gateway a header, whatever it sends after it;
2. the body is read up to `max_request_bytes` (a `Content-Length` over it is refused before
   reading, a longer chunked body as soon as it passes the limit): 413 in OpenAI's shape;
3. the route gets the body as one message; later `receive` calls (disconnect polling) go to
   the server as before.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict

import grpc

from gateway_svc.errors import ANTHROPIC_PATHS, GatewayError, too_large
from pagoda.client import AsyncClient, PagodaError

OPEN_PATHS = ("/health", "/metrics")


def bearer_key(scope) -> str | None:
    """The key of the request's `Authorization: Bearer <key>` (on Anthropic's paths, without one:
    its `x-api-key` header), None without one; a header that is not printable ASCII (gRPC
    metadata must be) is a 401."""
    headers = dict(scope["headers"])
    raw = headers.get(b"authorization", b"")
    anthropic_key = headers.get(b"x-api-key", b"") if scope.get("path") in ANTHROPIC_PATHS else b""
    if any(not 0x20 <= b < 0x7F for b in raw + anthropic_key):
        header = "Authorization" if any(not 0x20 <= b < 0x7F for b in raw) else "x-api-key"
        raise GatewayError(401, f"{header} header: must be printable ASCII", type="authentication_error",
                           param=None, code="invalid_api_key")
    scheme, _, key = raw.decode("ascii").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return key.strip()
    return anthropic_key.decode("ascii").strip() or None


# How long a verdict is kept: a key the scheduler stops taking (revoked: the scheduler restarted
# with another key file) is refused here this long after at most, a key it starts taking is
# taken as soon. One GetModelInfo per key and period: ~1 ms of a local scheduler's time.
VERDICT_TTL_S = 5.0
ACCEPTED_CAPACITY = 4096  # keys the scheduler took, least recently used dropped first
REFUSED_CAPACITY = 1024  # keys it refused, likewise: a flood of bogus keys evicts only its own kind


class _Expiring:
    """Key digests with an expiry time, at most `capacity`, the least recently used dropped first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._expiry: OrderedDict[bytes, float] = OrderedDict()

    def __contains__(self, digest: bytes) -> bool:
        expiry = self._expiry.get(digest)
        if expiry is None:
            return False
        if expiry <= time.monotonic():
            del self._expiry[digest]
            return False
        self._expiry.move_to_end(digest)
        return True

    def __len__(self) -> int:
        return len(self._expiry)

    def add(self, digest: bytes, ttl_s: float) -> None:
        self._expiry[digest] = time.monotonic() + ttl_s
        self._expiry.move_to_end(digest)
        while len(self._expiry) > self.capacity:
            self._expiry.popitem(last=False)

    def discard(self, digest: bytes) -> None:
        self._expiry.pop(digest, None)


class KeyVerdicts:
    """Whether the scheduler takes a key, from one GetModelInfo with it, remembered for `ttl_s`
    (by SHA-256). Taken and refused keys are kept apart, each bounded (`ACCEPTED_CAPACITY`,
    `REFUSED_CAPACITY`), so that bogus keys never push a valid one out. Concurrent checks of
    one key share one call."""

    def __init__(self, client: AsyncClient, ttl_s: float = VERDICT_TTL_S,
                 accepted_capacity: int = ACCEPTED_CAPACITY, refused_capacity: int = REFUSED_CAPACITY):
        self._client, self._ttl_s = client, ttl_s
        self.accepted, self.refused = _Expiring(accepted_capacity), _Expiring(refused_capacity)
        self._pending: dict[bytes, asyncio.Future] = {}

    async def check(self, key: str | None) -> None:
        """Return if the scheduler takes `key` (None: the gateway's own key, or none); else raise
        GatewayError (401, or the status of the scheduler's failure, which is not remembered)."""
        digest = hashlib.sha256((key or "").encode()).digest()
        if digest in self.accepted:
            return
        if digest in self.refused:
            taken = False
        else:
            pending = self._pending.get(digest)
            if pending is None:
                pending = self._pending[digest] = asyncio.ensure_future(self._ask(digest, key))
                pending.add_done_callback(lambda _: self._pending.pop(digest, None))
            taken = await asyncio.shield(pending)
        if not taken:
            raise GatewayError(401, "the API key was not accepted by the scheduler", type="authentication_error",
                               code="invalid_api_key")

    async def _ask(self, digest: bytes, key: str | None) -> bool:
        try:
            await self._client.model_info(api_key=key)
            taken = True
        except PagodaError as err:
            if err.code != grpc.StatusCode.UNAUTHENTICATED:
                raise GatewayError.from_pagoda(err) from None
            taken = False
        (self.accepted if taken else self.refused).add(digest, self._ttl_s)
        (self.refused if taken else self.accepted).discard(digest)
        return taken


class Admission:
    """The ASGI middleware described in the module docstring."""

    def __init__(self, app, verdicts: KeyVerdicts, max_request_bytes: int):
        self.app, self.verdicts, self.max_request_bytes = app, verdicts, max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        try:
            await self.verdicts.check(bearer_key(scope))
            body = await self._read_body(scope, receive)
        except GatewayError as err:
            response = err.anthropic_response() if scope["path"] in ANTHROPIC_PATHS else err.response()
            return await response(scope, receive, send)
        if body is None:  # the caller left while sending
            return None
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _read_body(self, scope, receive) -> bytes | None:
        limit = self.max_request_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise too_large(limit) if length.isdigit() else GatewayError(400, "Content-Length: not a number")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
