"""A caller that goes away while a non-streamed answer is made cancels it (and so its gRPC calls,
which aborts the requests on the scheduler and frees their KV blocks)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from fastapi.responses import Response

log = logging.getLogger("gateway_svc")

_DISCONNECT_POLL_S = 0.25


async def until_disconnected(request: Request, coro):
    """Await `coro`, cancelling it (and so its gRPC calls) if the caller disconnects."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                log.info("caller disconnected: request cancelled")
                return Response(status_code=499)
    finally:
        task.cancel()
