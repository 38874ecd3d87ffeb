"""The gRPC API's protections (issues #13, #24): API keys, TLS and mutual TLS, tenants' isolation
(for pagoda.v1.Generation and vllm.grpc.engine.VllmEngine alike).

Certificates are made in the test (tests/service/certs.py). The TLS service also requires
API keys from a key file with tenants, so the same scheduler shows all three at once. Its
executor link has no flag, so it also shows the default: CURVE with the per-user secret.
Issue #24's tests are written as the attacker's requests: another tenant's live request
id, a keyless flood on one connection, messages that do not parse, forged log lines.
"""

from __future__ import annotations

import collections
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2

from pagoda import link_security
from pagoda.client.connection import TLSConfig
from pagoda.v1 import executor_pb2 as xpb
from pagoda.v1 import generation_pb2 as pb
from pagoda.v1 import generation_pb2_grpc as pb_grpc
from tests.service.certs import make_pki
from tests.service.harness import SERVICE, Service, collect, greedy_request, hf_greedy, one_torch_thread
from tests.service.raw_peer import RawPeer

ALICE = "alice-key-0123456789abcdef"
ALICE_2 = "alice-key-2-0123456789abcdef"
BOB = "bob-key-0123456789abcdef"
LONE = "lone-key-0123456789abcdef"  # no tenant named: a tenant of its own
OPERATOR = "operator-key-0123456789abcdef"  # the admin key
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
    key_file.write_text(f"# key tenant\n{ALICE} alice\n{ALICE_2} alice\n{BOB} bob\n{LONE}\n{OPERATOR} ops admin\n")
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
    VLLM_RPCS[rpc](vllm_stub_with(service, pki, OPERATOR if rpc == "FlushCache" else BOB), timeout=60)


def test_only_an_admin_key_flushes_every_tenants_cache_and_its_wait_is_bounded(service, pki):
    """Issue #43: any tenant could empty every tenant's prefix cache, and make the RPC wait as long as it liked."""
    before = sum(e.num_cached_blocks for e in service.server_info().executors)
    for key in (ALICE, BOB, LONE):
        with pytest.raises(grpc.RpcError) as err:
            vllm_stub_with(service, pki, key).FlushCache(common_pb2.FlushCacheRequest(timeout_s=1), timeout=30)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "admin key" in err.value.details(), key
    assert sum(e.num_cached_blocks for e in service.server_info().executors) == before
    admin = vllm_stub_with(service, pki, OPERATOR)
    for timeout_s in (61.0, 1e9, float("inf")):
        with pytest.raises(grpc.RpcError) as err:
            admin.FlushCache(common_pb2.FlushCacheRequest(timeout_s=timeout_s), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "timeout_s: must be in [0, 60]" in err.value.details()
    assert admin.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10), timeout=30).success


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


# ---- issue #24: what one tenant, or a caller without a key, can do to the others -----------------

SHARED_ID = "job-42"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def alice_reference(hf_reference):
    model, _ = hf_reference
    with one_torch_thread():
        return hf_greedy(model, LONG_PROMPT[:24], MAX_TOKENS, ignore_eos=True)


def _start_stream(stub, request_id: str) -> tuple[threading.Thread, dict, threading.Event]:
    """Alice's greedy stream, collected in a thread; `started` is set at its first response."""
    result, started = {}, threading.Event()
    req = greedy_request(prompt_ids=LONG_PROMPT[:24], max_tokens=MAX_TOKENS, request_id=request_id, ignore_eos=True)

    def run():
        try:
            messages = []
            for message in stub.Generate(req, timeout=300):
                messages.append(message)
                started.set()
            result.update(collect(iter(messages)))
        except grpc.RpcError as exc:
            result["error"] = exc
        started.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result, started


def test_another_tenant_can_neither_detect_nor_abort_a_live_request(service, pki, alice_reference):
    alice, alice_2, bob, lone = (stub_with(service, pki, k) for k in (ALICE, ALICE_2, BOB, LONE))
    thread, result, started = _start_stream(alice, SHARED_ID)
    assert started.wait(120) and "error" not in result
    # bob, with his own key, sends alice's live id: accepted (he learns nothing), then aborts it
    bobs = collect(bob.Generate(greedy_request(prompt_ids=[5, 6, 7], max_tokens=2, request_id=SHARED_ID), timeout=120))
    assert bobs["first"].request_id == SHARED_ID and len(bobs["outputs"][0]["token_ids"]) == 2
    bob.Abort(pb.AbortRequest(request_ids=[SHARED_ID]), timeout=30)
    lone.Abort(pb.AbortRequest(request_ids=[SHARED_ID]), timeout=30)
    with pytest.raises(grpc.RpcError) as err:  # within alice's tenant the id is taken (her other key sees it)
        collect(alice_2.Generate(greedy_request(prompt_ids=[5], max_tokens=2, request_id=SHARED_ID), timeout=60))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    thread.join(300)
    out = result["outputs"][0]
    assert out["finish_reason"] == pb.FINISH_REASON_LENGTH  # not ABORTED
    assert out["token_ids"] == alice_reference


def test_server_info_shows_other_tenants_only_totals(service, pki):
    alice, bob = stub_with(service, pki, ALICE), stub_with(service, pki, BOB)
    thread, result, started = _start_stream(alice, "alice-secret-request-id")
    assert started.wait(120)
    info = bob.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    thread.join(300)
    assert info.num_running + info.num_waiting >= 1  # the load a router balances by
    shown = info.SerializeToString()
    assert b"alice-secret-request-id" not in shown and b"alice" not in shown
    assert "error" not in result


def test_a_keyless_flood_on_one_connection_is_unauthenticated_and_spares_other_callers(service, pki):
    """3,000 RPCs without a key on one connection: every one UNAUTHENTICATED (none CANCELLED), and a
    keyed caller on its own connection is served meanwhile."""
    flooder = stub_with(service, pki, None)
    with pytest.raises(grpc.RpcError):
        flooder.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)  # connected
    calls = [flooder.GetModelInfo.future(pb.GetModelInfoRequest(), timeout=120) for _ in range(3000)]
    bob = stub_with(service, pki, BOB)
    served = [bob.GetModelInfo(pb.GetModelInfoRequest(), timeout=60).vocab_size for _ in range(5)]
    codes = collections.Counter()
    for call in calls:
        try:
            call.result()
            codes[grpc.StatusCode.OK] += 1
        except grpc.RpcError as exc:
            codes[exc.code()] += 1
    assert codes == {grpc.StatusCode.UNAUTHENTICATED: 3000}, codes
    assert all(served)
    log = (service.logdir / "scheduler.log").read_text()
    assert log.count("without a valid API key") < 50  # counted, not one line each


def _raw_call(svc, pki, key, method: str, payload: bytes, stream: bool):
    channel = svc.open_channel(channel_credentials(str(pki.ca)), key)
    call = (channel.unary_stream if stream else channel.unary_unary)(f"/pagoda.v1.Generation/{method}")
    try:
        result = call(payload, timeout=30)
        return list(result) if stream else result
    finally:
        channel.close()


NOT_A_MESSAGE = "request: not a valid message"


@pytest.mark.parametrize("method, stream, payload, refusal", [
    # field 1 not UTF-8: Generate's request_id, Tokenize's text (named by the field)
    ("Generate", True, b"\x0a\x03\xff\xfe\xfd", "request_id: not valid UTF-8"),
    ("Tokenize", False, b"\x0a\x03\xff\xfe\xfd", "text: not valid UTF-8"),
    ("Generate", True, b"\x0a\xff\xff\xff\xff\x0f", NOT_A_MESSAGE),  # corrupt wire format
    ("Tokenize", False, b"\x0a\xff\xff\xff\xff\x0f", NOT_A_MESSAGE),
    # field 2: Generate's text prompt; Tokenize's chat, whose bytes are no message
    ("Generate", True, b"\x12\x04\xc3\x28ab", "text: not valid UTF-8"),
    ("Tokenize", False, b"\x12\x04\xc3\x28ab", NOT_A_MESSAGE),
])
def test_a_message_that_does_not_parse_is_invalid_argument(service, pki, method, stream, payload, refusal):
    with pytest.raises(grpc.RpcError) as err:
        _raw_call(service, pki, BOB, method, payload, stream)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith(refusal), err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # without a key it is never parsed
        _raw_call(service, pki, None, method, payload, stream)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert service.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).vocab_size > 0


def test_request_ids_are_logged_escaped(service):
    forged = "x\n2026-01-01 00:00:00,000 INFO scheduler_svc.engine: FORGED\x00\x1b[2J"
    out = collect(service.stub.Generate(greedy_request(prompt_ids=[5, 6], max_tokens=1, request_id=forged), timeout=120))
    assert out["first"].request_id == forged
    time.sleep(0.5)
    log = (service.logdir / "scheduler.log").read_text()
    assert "\x1b" not in log and "\x00" not in log
    assert not any(line.startswith("2026-01-01") for line in log.splitlines())
    assert repr(forged) in log


def test_the_default_executor_link_is_curve(service):
    """No link flag at all (this service's scheduler has none): CURVE with the per-user secret."""
    log = (service.logdir / "scheduler.log").read_text()
    assert "executors connect to" in log and "(CURVE)" in log and "per-user secret" in log
    path = link_security.default_secret_path()
    assert path.stat().st_mode & 0o777 == 0o600
    assert "CURVE" in (service.logdir / "executor0.log").read_text()  # and the executor found it
    intruder = RawPeer(service.zmq, "intruder")  # plaintext, as any local process could before
    try:
        intruder.send(hello=xpb.Hello(executor_id="intruder"))
        assert intruder.recv_all(3.0) == []
    finally:
        intruder.close()
    assert [e.executor_id for e in service.server_info().executors] != ["intruder"]
    assert len(service.server_info().executors) == 1
