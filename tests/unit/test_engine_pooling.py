"""Pooling requests (Embed, Rerank) take the engine's one admission path: the tenant's share, the
queue bound, in-flight ids, the fair queue (one turn an input) and abort. No executor runs here:
requests wait in the engine's queue, which is all these rules need."""

from __future__ import annotations

import asyncio

import pytest

from pagoda.step import PoolTask
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.errors import AlreadyExists, ResourceExhausted
from scheduler_svc.pooling_stream import Aborted, PoolInput, PoolParams


@pytest.fixture
def make_engine():
    engines = []

    def make(**config) -> Engine:
        engine = Engine(EngineConfig(model_fingerprint="x", runner="pooling", **config), None, "tcp://127.0.0.1:0")
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.pool.link.close()


def params(request_id: str, num_inputs: int = 1) -> PoolParams:
    return PoolParams(request_id, [PoolInput([101, 7 + i, 102]) for i in range(num_inputs)], PoolTask.EMBED)


def test_each_input_is_a_turn_and_tenants_alternate(make_engine):
    engine = make_engine()
    engine.submit_pooling(params("big", 3), tenant="flooder")
    engine.submit_pooling(params("small", 1), tenant="bystander")
    order = [entry.requests[0].req_id for entry in engine.queue.in_order()]
    # the bystander's one input is bound after at most one of the flooder's, not behind all three
    assert order[:2] == ["0:big-0", "0:small-1"] and len(order) == 4
    assert all(entry.requests[0].pool.task is PoolTask.EMBED for entry in engine.queue.entries)


def test_a_tenants_share_and_the_queue_bound_count_pooling_requests(make_engine):
    engine = make_engine(max_requests_per_tenant=1, max_waiting_requests=4)
    engine.submit_pooling(params("a"), tenant="alice")
    with pytest.raises(ResourceExhausted, match="--max-requests-per-tenant 1"):
        engine.submit_pooling(params("b"), tenant="alice")
    engine.submit_pooling(params("a", 3), tenant="bob")  # the same id in another tenant
    with pytest.raises(ResourceExhausted, match="waiting queue is full"):
        engine.submit_pooling(params("c"), tenant="carol")


def test_in_flight_id_is_refused_and_abort_ends_the_call(make_engine):
    async def scenario():
        engine = make_engine()
        stream = engine.submit_pooling(params("job", 2), tenant="t")
        with pytest.raises(AlreadyExists):
            engine.submit_pooling(params("job"), tenant="t")
        engine.abort("job", tenant="t")
        with pytest.raises(Aborted):
            await stream.result()
        assert engine.queue.num_requests == 0 and not engine.requests and len(engine.owners) == 0
        engine.submit_pooling(params("job"), tenant="t")  # the id is free again

    asyncio.run(scenario())


def test_an_executor_of_the_other_runner_is_refused(make_engine):
    from pagoda.v1 import executor_pb2 as xpb

    pooling = make_engine()
    register = dict(model_fingerprint="x", block_size=16, num_kv_blocks=2, device="cpu")
    assert "runner 'generate' differs from the scheduler's 'pooling'" in pooling.pool._registration_problem(
        xpb.Register(**register, runner="generate"))
    assert "runner 'generate'" in pooling.pool._registration_problem(xpb.Register(**register))  # (older executors)
    assert pooling.pool._registration_problem(xpb.Register(**register, runner="pooling")) == ""
    generation = Engine(EngineConfig(model_fingerprint="x"), None, "tcp://127.0.0.1:0")
    try:
        assert "runner 'pooling' differs" in generation.pool._registration_problem(xpb.Register(**register, runner="pooling"))
        assert generation.pool._registration_problem(xpb.Register(**register, runner="generate")) == ""
    finally:
        generation.pool.link.close()
