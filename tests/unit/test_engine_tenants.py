"""Requests are keyed by (tenant, request_id) in the engine (issue #24); each tenant has its share.

The engine runs here with no executor: requests wait in its queue, which is all these rules need.
Tenant B plays the attacker with tenant A's live request id.
"""

from __future__ import annotations

import pytest

from pagoda import model_files
from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.errors import AlreadyExists, ResourceExhausted
from scheduler_svc.tokenizer import load_tokenizer, read_model_spec
from scheduler_svc.validation import validate_generate


@pytest.fixture(scope="module")
def tokenizer_and_spec():
    model_dir = model_files.resolve_model(None, weights=False)
    tokenizer = load_tokenizer(model_dir)
    return tokenizer, read_model_spec(model_dir, tokenizer)


@pytest.fixture
def make_engine(tokenizer_and_spec):
    engines = []

    def make(**config) -> Engine:
        engine = Engine(EngineConfig(model_fingerprint="x", **config), tokenizer_and_spec[0], "tcp://127.0.0.1:0")
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.pool.link.close()


def params(tokenizer_and_spec, request_id: str):
    tokenizer, spec = tokenizer_and_spec
    req = pb.GenerateRequest(request_id=request_id, text="Hello there")
    req.stopping.max_tokens = 4
    return validate_generate(req, tokenizer, spec, max_model_len=2048)


def test_another_tenant_can_neither_detect_nor_abort_a_live_request(make_engine, tokenizer_and_spec):
    engine = make_engine()
    alice = engine.submit(params(tokenizer_and_spec, "job-1"), tenant="alice")
    with pytest.raises(AlreadyExists):  # alice's own id twice: refused
        engine.submit(params(tokenizer_and_spec, "job-1"), tenant="alice")
    bob = engine.submit(params(tokenizer_and_spec, "job-1"), tenant="bob")  # the same id: bob learns nothing
    assert {s.core_req_id for s in alice.samples}.isdisjoint(s.core_req_id for s in bob.samples)
    assert alice.params.cache_salt != bob.params.cache_salt  # and no prefix-cache hit across them
    engine.abort("job-1", tenant="bob")
    assert bob.done and not alice.done
    assert bob.samples[0].finish_reason == pb.FINISH_REASON_ABORTED
    assert engine.queue.num_requests == 1  # alice's is still waiting
    engine.abort("job-1", tenant="carol")  # unknown to carol: ignored
    assert not alice.done
    engine.abort("job-1", tenant="alice")
    assert alice.done and engine.queue.num_requests == 0 and not engine.requests


def test_a_tenant_over_its_share_is_refused_and_the_others_are_not(make_engine, tokenizer_and_spec):
    engine = make_engine(max_requests_per_tenant=2, max_waiting_requests=8)
    flood = [engine.submit(params(tokenizer_and_spec, f"f{i}"), tenant="flooder") for i in range(2)]
    with pytest.raises(ResourceExhausted, match="--max-requests-per-tenant 2"):
        engine.submit(params(tokenizer_and_spec, "f2"), tenant="flooder")
    with pytest.raises(ResourceExhausted):
        engine.check_admission("flooder")  # what the servicer asks before it tokenizes
    engine.check_admission("bystander")
    engine.submit(params(tokenizer_and_spec, "b0"), tenant="bystander")
    engine.abort("f0", tenant="flooder")
    assert flood[0].done
    engine.submit(params(tokenizer_and_spec, "f2"), tenant="flooder")  # room again once one ended
    for i in range(3):  # without API keys (tenant "") only the queue bounds requests
        engine.submit(params(tokenizer_and_spec, f"n{i}"), tenant="")
    assert engine.queue.num_requests == 6
