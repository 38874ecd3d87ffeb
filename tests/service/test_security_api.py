"""The gRPC API's protections (issue #13): API keys, TLS and mutual TLS, tenant isolation of the prefix cache
(for pagoda.v1.Generation and vllm.grpc.engine.VllmEngine alike).

Certificates are made in the test (tests/service/certs.py). The TLS service also requires
API keys from a key file with tenants, so the same scheduler shows all three at once.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2

from pagoda.v1 import generation_pb2 as pb
from pagoda.v1 import generation_pb2_grpc as pb_grpc
from pagoda.client.connection import TLSConfig
from tests.service.certs import make_pki
from tests.service.harness import SERVICE, Service, collect, greedy_request

ALICE = "alice-key-0123456789abcdef"
ALICE_2 = "alice-key-2-0123456789abcdef"
BOB = "bob-key-0123456789abcdef"
LONE = "lone-key-0123456789abcdef"  # no tenant named: a tenant of its own
# 160 tokens: ten full blocks of 16, the same for every tenant
LONG_PROMPT = [(i * 37) % 1000 + 100 for i in range(160)]

RPCS = {
    "Generate": lambda stub, **kw: collect(stub.Generate(greedy_request(prompt_ids=[1, 2, 3], max_tokens=2), **kw)),
    "Abort": lambda stub, **kw: stub.Abort(pb.AbortRequest(request_ids=["x"]), **kw),
    "Tokenize": lambda stub, **kw: stub.Tokenize(pb.TokenizeRequest(text="hello"), **kw),
    "GetModelInfo": lambda stub, **kw: stub.GetModelInfo(pb.GetModelInfoRequest(), **kw),
    "GetServerInfo": lambda stub, **kw: stub.GetServerInfo(pb.GetServerInfoRequest(), **kw),
}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def service(pki, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(f"# key tenant\n{ALICE} alice\n{ALICE_2} alice\n{BOB} bob\n{LONE}\n")
    tls = ["--ssl-certfile", str(pki.server_cert), "--ssl-keyfile", str(pki.server_key)]
    creds = channel_credentials(str(pki.ca))
    with Service(
        scheduler_args=[*tls, "--api-key-file", str(key_file)], executor_args=["--num-threads", "1"],
        channel_credentials=creds, api_key=ALICE,
    ) as svc:
        yield svc


def channel_credentials(ca: str, cert: str | None = None, key: str | None = None) -> grpc.ChannelCredentials:
    return TLSConfig.from_files(ca, cert, key).credentials()


def stub_with(svc: Service, pki, key: str | None) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(svc.open_channel(channel_credentials(str(pki.ca)), key))


@pytest.mark.parametrize("rpc", sorted(RPCS))
def test_every_generation_rpc_needs_a_valid_key(service, pki, rpc):
    call = RPCS[rpc]
    for key in (None, "wrong-key-0123456789abcdef", ALICE[:-1]):
        with pytest.raises(grpc.RpcError) as err:
            call(stub_with(service, pki, key), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (rpc, key)
        assert "API key" in err.value.details()
    bare = pb_grpc.GenerationStub(grpc.secure_channel(f"127.0.0.1:{service.port}", channel_credentials(str(pki.ca))))
    with pytest.raises(grpc.RpcError) as err:  # a malformed header is no key either
        call(bare, timeout=30, metadata=[("authorization", f"Basic {ALICE}")])
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    call(stub_with(service, pki, BOB), timeout=60)  # the right key works


def test_health_and_reflection_need_no_key(service, pki):
    channel = grpc.secure_channel(f"127.0.0.1:{service.port}", channel_credentials(str(pki.ca)))
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    (answer,) = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    assert SERVICE in [s.name for s in answer.list_services_response.service]


def test_tls_client_streams_and_a_plaintext_client_fails(service):
    result = collect(service.stub.Generate(greedy_request(prompt_ids=[1, 2, 3, 4], max_tokens=4), timeout=60))
    assert len(result["outputs"][0]["token_ids"]) == 4
    plain = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{service.port}"))
    with pytest.raises(grpc.RpcError) as err:
        plain.GetModelInfo(pb.GetModelInfoRequest(), timeout=10, metadata=[("authorization", f"Bearer {ALICE}")])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def cached_tokens(stub, salt: str = "") -> int:
    req = greedy_request(prompt_ids=LONG_PROMPT, max_tokens=2)
    req.cache_salt = salt
    return collect(stub.Generate(req, timeout=120))["first"].prompt_info.num_cached_tokens


def test_tenants_and_salts_never_share_cached_blocks(service, pki):
    alice, alice_2, bob, lone = (stub_with(service, pki, k) for k in (ALICE, ALICE_2, BOB, LONE))
    full_hit = 160 - 16  # every full block but the last (its last token's logits are needed)
    assert cached_tokens(alice) == 0
    assert cached_tokens(alice) == full_hit  # the same tenant hits
    assert cached_tokens(alice_2) == full_hit  # another key of the same tenant too
    assert cached_tokens(bob) == 0  # another tenant does not
    assert cached_tokens(bob) == full_hit
    assert cached_tokens(lone) == 0
    assert cached_tokens(alice, salt="per-user-1") == 0  # a salt isolates within a tenant
    assert cached_tokens(alice, salt="per-user-1") == full_hit
    assert cached_tokens(alice, salt="per-user-2") == 0
    with pytest.raises(grpc.RpcError) as err:
        cached_tokens(alice, salt="x" * 257)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in err.value.details()


def test_mutual_tls_refuses_a_client_without_a_certificate(pki):
    tls = ["--ssl-certfile", str(pki.server_cert), "--ssl-keyfile", str(pki.server_key), "--ssl-ca-certs", str(pki.ca)]
    mutual = channel_credentials(str(pki.ca), str(pki.client_cert), str(pki.client_key))
    with Service(num_executors=0, scheduler_args=tls, channel_credentials=mutual) as svc:
        info = _wait_model_info(svc.stub)
        assert info.vocab_size > 0
        no_cert = pb_grpc.GenerationStub(svc.open_channel(channel_credentials(str(pki.ca))))
        with pytest.raises(grpc.RpcError) as err:
            no_cert.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def _wait_model_info(stub, timeout: float = 120.0) -> pb.ModelInfo:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


# ---- vllm.grpc.engine.VllmEngine: the same keys, and KV events only of the caller's tenant ----

VLLM_RPCS = {
    "Generate": lambda stub, **kw: list(stub.Generate(
        vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]),
                            sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=2)), **kw)),
    "Abort": lambda stub, **kw: stub.Abort(vpb.AbortRequest(request_ids=["x"]), **kw),
    "HealthCheck": lambda stub, **kw: stub.HealthCheck(vpb.HealthCheckRequest(), **kw),
    "GetModelInfo": lambda stub, **kw: stub.GetModelInfo(vpb.GetModelInfoRequest(), **kw),
    "GetServerInfo": lambda stub, **kw: stub.GetServerInfo(vpb.GetServerInfoRequest(), **kw),
    "GetLoads": lambda stub, **kw: stub.GetLoads(vpb.GetLoadsRequest(), **kw),
    "GetTokenizer": lambda stub, **kw: list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), **kw)),
    "FlushCache": lambda stub, **kw: stub.FlushCache(common_pb2.FlushCacheRequest(), **kw),
}


def vllm_stub_with(svc: Service, pki, key: str | None) -> vpb_grpc.VllmEngineStub:
    return vpb_grpc.VllmEngineStub(svc.open_channel(channel_credentials(str(pki.ca)), key))


@pytest.mark.parametrize("rpc", sorted(VLLM_RPCS))
def test_every_vllm_engine_rpc_needs_a_valid_key(service, pki, rpc):
    for key in (None, "wrong-key-0123456789abcdef"):
        with pytest.raises(grpc.RpcError) as err:
            VLLM_RPCS[rpc](vllm_stub_with(service, pki, key), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (rpc, key)
    VLLM_RPCS[rpc](vllm_stub_with(service, pki, BOB), timeout=60)


def stored_token_ids(batches) -> list[tuple[int, ...]]:
    return [tuple(block.token_ids) for batch in batches for event in batch.events if event.HasField("stored")
            for block in event.stored.blocks]


def test_kv_events_show_a_tenant_only_its_own_blocks(service, pki):
    """A subscriber's stream holds the tokens of cached blocks: never another tenant's."""
    batches: list = []
    call = vllm_stub_with(service, pki, ALICE).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=120)

    def read():
        try:
            for batch in call:
                batches.append(batch)
        except grpc.RpcError:
            pass  # cancelled below

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    bob_prompt = [(i * 53) % 900 + 2000 for i in range(64)]
    alice_prompt = [(i * 59) % 900 + 3000 for i in range(64)]
    for key, prompt in ((BOB, bob_prompt), (ALICE, alice_prompt)):
        collect(stub_with(service, pki, key).Generate(greedy_request(prompt_ids=prompt, max_tokens=2), timeout=120))
    deadline = time.monotonic() + 30
    while tuple(alice_prompt[:16]) not in stored_token_ids(batches) and time.monotonic() < deadline:
        time.sleep(0.1)
    call.cancel()
    reader.join(10)
    seen = stored_token_ids(batches)
    assert tuple(alice_prompt[:16]) in seen and tuple(alice_prompt[16:32]) in seen
    assert not any(block == tuple(bob_prompt[i:i + 16]) for block in seen for i in range(0, 64, 16))
