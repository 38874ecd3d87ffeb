"""The executor link with a cluster secret (issue #13): who gets in, and who may speak for whom.

One scheduler with `--cluster-secret-file` and one real executor holding the secret; intruders
are raw ZeroMQ peers (tests/service/raw_peer.py). Every served request is compared with
transformers' greedy continuation, so "nothing changed" means the streams are exactly right.
"""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest
import zmq
from grpc_health.v1 import health_pb2

from pagoda import link_security, model_files
from pagoda.v1 import executor_pb2 as xpb
from tests.service.harness import SERVICE, Service, chat_ids, collect, greedy_request, hf_greedy, one_torch_thread
from tests.service.raw_peer import RawPeer

PROMPT = "Name three rivers in Europe."
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    return link_security.make_cluster_secret(tmp_path_factory.mktemp("secret") / "cluster.secret")


@pytest.fixture(scope="module")
def reference(hf_reference):
    model, tokenizer = hf_reference
    prompt = chat_ids(tokenizer, PROMPT)
    with one_torch_thread():
        return prompt, hf_greedy(model, prompt, MAX_TOKENS)


@pytest.fixture(scope="module")
def service(secret_file, reference):
    args = ["--cluster-secret-file", str(secret_file)]
    with Service(scheduler_args=[*args, "--executor-timeout", "2"], executor_args=[*args, "--num-threads", "1"]) as svc:
        yield svc


@pytest.fixture(scope="module")
def keys(secret_file):
    return link_security.derive_link_keys(link_security.read_cluster_secret(secret_file))


def fingerprint() -> str:
    return model_files.fingerprint(model_files.resolve_model(None))


def register_msg(executor_id: str, num_kv_blocks: int = 64) -> dict:
    return dict(register=xpb.Register(
        executor_id=executor_id, model_fingerprint=fingerprint(), block_size=16,
        num_kv_blocks=num_kv_blocks, device="cpu", vocab_size=49152,
    ))


def assert_serves_reference(svc: Service, reference) -> None:
    prompt, expected = reference
    out = collect(svc.stub.Generate(greedy_request(prompt_ids=prompt, max_tokens=MAX_TOKENS), timeout=120))
    assert out["outputs"][0]["token_ids"] == expected


def metric(svc: Service, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name))


def zmtp_null_peer(messages: list[bytes]) -> bytes:
    """What a DEALER with the NULL mechanism writes: greeting, READY, then one single-frame message each."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    prop = b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    ready = b"\x05READY" + prop
    out = greeting + bytes([0x04, len(ready)]) + ready
    for message in messages:
        out += bytes([0x02]) + len(message).to_bytes(8, "big") + message  # long frame, last
    return out


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def executor_ids(svc: Service) -> list[str]:
    return sorted(e.executor_id for e in svc.server_info().executors)


def test_peer_without_the_secret_hears_nothing_and_registers_nothing(service, reference, keys):
    before = executor_ids(service)
    assert len(before) == 1
    rejected_before = metric(service, "pagoda:executor_link_rejected_connections_total")
    intruders = [
        RawPeer(service.zmq, "plain"),  # plaintext ZMTP
        # CURVE with the right server key (as if it leaked) but its own client key: ZAP says no
        RawPeer(service.zmq, "curve", curve=(keys.server_public, *zmq.curve_keypair())),
    ]
    host, port = service.zmq.removeprefix("tcp://").rsplit(":", 1)
    # ZMTP 3.0 by hand, so that the bytes go out whatever the server says: a NULL greeting,
    # READY, then Hello and Register frames, then junk.
    raw = socket.create_connection((host, int(port)))
    try:
        for peer in intruders:
            peer.send(hello=xpb.Hello(executor_id=peer.sock.getsockopt(zmq.IDENTITY).decode()))
            peer.send(**register_msg("plain"))
            peer.send_raw(b"\x00\xffjunk" * 10)
        raw.sendall(zmtp_null_peer(
            [xpb.ExecutorMessage(hello=xpb.Hello(executor_id="raw")).SerializeToString(),
             xpb.ExecutorMessage(**register_msg("raw")).SerializeToString()]
        ) + b"\xffjunk" * 16)
        assert_serves_reference(service, reference)  # served meanwhile, unchanged
        for peer in intruders:
            assert peer.recv_all(3.0) == [], "an intruder got an answer"
        # Nothing but libzmq's own greeting (64 bytes naming the CURVE mechanism), then the door closes.
        assert len(read_until_closed(raw, 3.0)) <= 64
    finally:
        raw.close()
        for peer in intruders:
            peer.close()
    assert executor_ids(service) == before
    assert metric(service, "pagoda:executor_link_rejected_connections_total") >= rejected_before + 2


def test_executor_with_the_wrong_secret_cannot_register(service, reference, tmp_path):
    wrong = link_security.make_cluster_secret(tmp_path / "wrong.secret")
    before = executor_ids(service)
    proc = service.add_executor(["--cluster-secret-file", str(wrong)])
    try:
        log = service.logdir / f"executor{len(service.executors) - 1}.log"
        deadline = time.monotonic() + 120
        while "waiting for the scheduler" not in log.read_text():  # weights loaded, handshake failing
            assert time.monotonic() < deadline, log.read_text()
            assert proc.poll() is None, log.read_text()
            time.sleep(0.5)
        time.sleep(2)
        assert executor_ids(service) == before
        assert "registered" not in log.read_text()
        assert_serves_reference(service, reference)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        service.executors.remove(proc)


def test_a_peer_with_the_secret_cannot_speak_for_another_executor(service, reference, keys):
    (victim,) = executor_ids(service)
    total_blocks = service.server_info().executors[0].num_total_blocks
    dropped_before = metric(service, "pagoda:executor_link_dropped_messages_total")
    mallory = RawPeer(service.zmq, "mallory", keys=keys)
    mallory_hb = RawPeer(service.zmq, "mallory/hb", keys=keys)
    squatter = RawPeer(service.zmq, f"{victim}/hb", keys=keys)  # the victim's heartbeat identity is taken
    try:
        mallory.send(goodbye=xpb.Goodbye(executor_id=victim, reason="forged"))
        mallory.send(**register_msg(victim, num_kv_blocks=8))
        mallory.send(hello=xpb.Hello(executor_id=victim))
        mallory.send(heartbeat=xpb.Heartbeat(executor_id=victim))
        mallory_hb.send(heartbeat=xpb.Heartbeat(executor_id=victim))
        squatter.send(goodbye=xpb.Goodbye(executor_id=victim, reason="forged"))
        squatter.send(heartbeat=xpb.Heartbeat(executor_id=victim, token=b"guess"))
        assert_serves_reference(service, reference)
        assert mallory.recv_all(1.0) == [] and squatter.recv_all(0.5) == []
    finally:
        for peer in (mallory, mallory_hb, squatter):
            peer.close()
    info = service.server_info()
    assert [(e.executor_id, e.healthy, e.num_total_blocks) for e in info.executors] == [(victim, True, total_blocks)]
    assert metric(service, "pagoda:executor_link_dropped_messages_total") >= dropped_before + 4
    log = (service.logdir / "scheduler.log").read_text()
    assert f"goodbye naming executor '{victim}'" in log and "moving its requests" not in log


def test_registering_a_huge_pool_keeps_the_loop_answering_and_the_bound_holds(service, reference, keys):
    big = RawPeer(service.zmq, "big", keys=keys)
    too_big = RawPeer(service.zmq, "too-big", keys=keys)
    try:
        big.send(hello=xpb.Hello(executor_id="big"))
        assert big.recv(10).WhichOneof("kind") == "config"
        big.send(**register_msg("big", num_kv_blocks=3_000_000))
        # The loop keeps answering while (and after) the pool is made: every check answers in 1 s.
        for _ in range(10):
            status = service.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=1.0).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            time.sleep(0.1)
        assert big.recv(5).WhichOneof("kind") == "registered"
        sizes = {e.executor_id: e.num_total_blocks for e in service.server_info().executors}
        assert sizes["big"] == 3_000_000 - 1
        big.send(goodbye=xpb.Goodbye(executor_id="big", reason="done"))

        too_big.send(**register_msg("too-big", num_kv_blocks=2**32 - 1))
        reply = too_big.recv(10)
        assert reply.WhichOneof("kind") == "shutdown" and "--max-kv-blocks" in reply.shutdown.reason
    finally:
        big.close()
        too_big.close()
    deadline = time.monotonic() + 10
    while "big" in executor_ids(service):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert "too-big" not in executor_ids(service)
    assert_serves_reference(service, reference)


def test_a_message_over_the_size_limit_is_never_read(service, reference, keys):
    """Issue #24: a peer with the secret sends 64 MiB, more than any honest executor message."""
    dropped_before = metric(service, "pagoda:executor_link_dropped_messages_total")
    peer = RawPeer(service.zmq, "big-sender", keys=keys)
    try:
        peer.send_raw(b"\xff" * (64 * 2**20))  # junk: if it were read, it would be dropped as unparsable
        assert_serves_reference(service, reference)
        deadline = time.monotonic() + 30
        reply = None
        while reply is None and time.monotonic() < deadline:  # ZeroMQ dropped the connection; it reconnects
            peer.send(hello=xpb.Hello(executor_id="big-sender"))
            reply = peer.recv(2.0)
        assert reply is not None and reply.WhichOneof("kind") == "config"  # small messages are read
    finally:
        peer.close()
    assert metric(service, "pagoda:executor_link_dropped_messages_total") == dropped_before
    assert "unparsable message from connection 'big-sender'" not in (service.logdir / "scheduler.log").read_text()


def test_a_message_of_many_frames_is_thrown_away_and_its_sender_banned(service, reference, keys):
    """ZMQ_MAXMSGSIZE bounds a frame: 40 frames of 1 MiB each, each under the limit, are one message no
    honest executor sends (they send one frame). It is read a frame at a time, never gathered."""
    dropped_before = metric(service, "pagoda:executor_link_dropped_messages_total")
    peer = RawPeer(service.zmq, "many-frames", keys=keys)
    try:
        hello = xpb.ExecutorMessage(hello=xpb.Hello(executor_id="many-frames")).SerializeToString()
        peer.sock.send_multipart([hello] + [b"\x00" * 2**20] * 40)
        assert_serves_reference(service, reference)
        peer.send(hello=xpb.Hello(executor_id="many-frames"))
        assert peer.recv(2.0) is None  # banned: not even a config for a fresh Hello
    finally:
        peer.close()
    assert metric(service, "pagoda:executor_link_dropped_messages_total") == dropped_before + 1
    assert "a message of 41 frames" in (service.logdir / "scheduler.log").read_text()
