"""What every OpenAI request passes before a route sees it: the caller's key, then a bounded body.

`Admission` is a raw ASGI middleware on every path but /health and /metrics:

1. the `Authorization` header must be ASCII, and its key (or, with none, the gateway's own
   `--api-key`) one the scheduler takes: asked once with GetModelInfo and remembered
   (`KeyVerdicts`). A key the scheduler refuses is answered 401 before one byte of the body
   is read, so a caller without a key costs the gateway a header, whatever it sends after it;
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

from gateway_svc.errors import GatewayError, too_large
from pagoda.client import AsyncClient, PagodaError

OPEN_PATHS = ("/health", "/metrics")


def bearer_key(scope) -> str | None:
    """The key of the request's `Authorization: Bearer <key>`, None without one; a header that
    is not printable ASCII (gRPC metadata must be) is a 401."""
    raw = dict(scope["headers"]).get(b"authorization", b"")
    if any(not 0x20 <= b < 0x7F for b in raw):
        raise GatewayError(401, "Authorization header: must be printable ASCII", type="authentication_error",
                           param=None, code="invalid_api_key")
    scheme, _, key = raw.decode("ascii").partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


class KeyVerdicts:
    """Whether the scheduler takes a key, from one GetModelInfo with it, remembered for `ttl_s`
    (by SHA-256, at most `capacity` keys, least recently used dropped first). Concurrent
    checks of one key share one call."""

    def __init__(self, client: AsyncClient, ttl_s: float = 60.0, capacity: int = 4096):
        self._client, self._ttl_s, self._capacity = client, ttl_s, capacity
        self._verdicts: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()
        self._pending: dict[bytes, asyncio.Future] = {}

    async def check(self, key: str | None) -> None:
        """Return if the scheduler takes `key` (None: the gateway's own key, or none); else raise
        GatewayError (401, or the status of the scheduler's failure, which is not remembered)."""
        digest = hashlib.sha256((key or "").encode()).digest()
        verdict = self._verdicts.get(digest)
        if verdict is None or verdict[1] < time.monotonic():
            pending = self._pending.get(digest)
            if pending is None:
                pending = self._pending[digest] = asyncio.ensure_future(self._ask(digest, key))
                pending.add_done_callback(lambda _: self._pending.pop(digest, None))
            verdict = await asyncio.shield(pending)
        elif digest in self._verdicts:
            self._verdicts.move_to_end(digest)
        if not verdict[0]:
            raise GatewayError(401, "the API key was not accepted by the scheduler", type="authentication_error",
                               code="invalid_api_key")

    async def _ask(self, digest: bytes, key: str | None) -> tuple[bool, float]:
        try:
            await self._client.model_info(api_key=key)
            taken = True
        except PagodaError as err:
            if err.code != grpc.StatusCode.UNAUTHENTICATED:
                raise GatewayError.from_pagoda(err) from None
            taken = False
        verdict = (taken, time.monotonic() + self._ttl_s)
        self._verdicts[digest] = verdict
        while len(self._verdicts) > self._capacity:
            self._verdicts.popitem(last=False)
        return verdict


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
            return await err.response()(scope, receive, send)
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
