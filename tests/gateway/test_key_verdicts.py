"""The gateway's memory of which keys the scheduler takes (issue #43): a revoked key stops within
seconds, and a stream of bogus keys cannot push a valid key out.

Before: a verdict was kept 60 s (a revoked key went on working that long) in one LRU of 4,096 keys
that bogus keys shared with valid ones, so 4,096 bogus keys made every valid key be asked again.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx2 as httpx
import pytest

from gateway_svc import admission
from gateway_svc.admission import VERDICT_TTL_S, KeyVerdicts
from gateway_svc.errors import GatewayError
from pagoda.client import PagodaError
from pagoda.v1 import generation_pb2 as pb
from tests.client.keyed_server import KEY, KeyedServicer, insecure_keyed_server
from tests.gateway.gateway import Gateway

pytestmark = pytest.mark.timeout(120)

VALID = "valid-key-0123456789abcdef"


class FakeClient:
    """Takes the keys in `keys`; counts GetModelInfo calls per key."""

    def __init__(self, keys):
        self.keys, self.calls = set(keys), {}

    async def model_info(self, api_key=None):
        self.calls[api_key] = self.calls.get(api_key, 0) + 1
        if api_key not in self.keys:
            raise PagodaError("no", grpc.StatusCode.UNAUTHENTICATED)


async def taken(verdicts: KeyVerdicts, key: str) -> bool:
    try:
        await verdicts.check(key)
        return True
    except GatewayError as err:
        assert err.status == 401
        return False


def test_bogus_keys_never_push_a_valid_one_out():
    client = FakeClient({VALID})
    verdicts = KeyVerdicts(client, ttl_s=3600, accepted_capacity=8, refused_capacity=8)

    async def run():
        assert await taken(verdicts, VALID)
        for i in range(1000):
            assert not await taken(verdicts, f"bogus-{i:04d}-0123456789abcdef")
        assert await taken(verdicts, VALID)

    asyncio.run(run())
    assert client.calls[VALID] == 1  # still remembered: not asked again
    assert len(verdicts.refused) == 8 and len(verdicts.accepted) == 1


def test_a_verdict_is_asked_again_after_the_ttl(monkeypatch):
    client, now = FakeClient({VALID}), [1000.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: now[0])
    verdicts = KeyVerdicts(client)

    async def run():
        assert await taken(verdicts, VALID) and await taken(verdicts, VALID)
        assert client.calls[VALID] == 1
        client.keys.clear()  # revoked
        now[0] += VERDICT_TTL_S - 0.1
        assert await taken(verdicts, VALID)
        now[0] += 0.2
        assert not await taken(verdicts, VALID)
        client.keys.add(VALID)  # and taken again: also within the TTL
        now[0] += VERDICT_TTL_S + 0.1
        assert await taken(verdicts, VALID)

    asyncio.run(run())
    assert VERDICT_TTL_S <= 10


class RevocableServicer(KeyedServicer):
    """A stand-in scheduler whose key can be revoked while it runs."""

    def __init__(self):
        self.revoked = False

    def _check(self, context):
        if self.revoked:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or wrong API key")
        super()._check(context)

    def GetModelInfo(self, request, context):
        self._check(context)
        return pb.ModelInfo(name="keyed", vocab_size=3)


def test_a_revoked_key_stops_at_the_gateway_within_seconds():
    servicer = RevocableServicer()
    with insecure_keyed_server(servicer) as target, Gateway(target) as gateway:
        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{gateway.url}/v1/models", headers=headers, timeout=10).status_code == 200
        servicer.revoked = True
        start = time.monotonic()
        while httpx.get(f"{gateway.url}/v1/models", headers=headers, timeout=10).status_code == 200:
            assert time.monotonic() - start < VERDICT_TTL_S + 5, "the revoked key still works"
            time.sleep(0.25)
