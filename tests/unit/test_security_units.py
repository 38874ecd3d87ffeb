"""Pure pieces of issues #13 and #24: key derivation, the link's default secret, API keys, result checks, salts, lazy pool."""

from __future__ import annotations

import math
import os
import random
import threading

import pytest
import zmq

from pagoda import link_security
from pagoda.v1 import executor_pb2 as xpb
from pagoda import wire
from pagoda.step import MAX_ERROR_MESSAGE_CHARS, RequestError, SampledToken, StepResult
from scheduler_svc.auth import ApiKeyInterceptor, load_api_keys, prefix_cache_salt
from scheduler_svc.core.block_hash import ROOT_HASH, block_hashes_of, root_hash
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.request import Request
from scheduler_svc.result_check import (
    MAX_CORE_REQ_ID_BYTES,
    MAX_TOP_LOGPROBS_PER_TOKEN,
    max_executor_message_bytes,
    result_shape_problem,
    sampled_values_problem,
)


def test_both_sides_derive_the_same_working_keys_and_other_secrets_differ(tmp_path):
    path = link_security.make_cluster_secret(tmp_path / "s")
    assert os.stat(path).st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        link_security.make_cluster_secret(path)
    secret = link_security.read_cluster_secret(path)
    a, b = link_security.derive_link_keys(secret), link_security.derive_link_keys(secret)
    assert a == b and a.server_public != a.client_public
    assert zmq.curve_public(a.server_secret) == a.server_public
    assert zmq.curve_public(a.client_secret) == a.client_public
    other = link_security.derive_link_keys(b"x" * 64)
    assert {other.server_public, other.client_public}.isdisjoint({a.server_public, a.client_public})
    assert a.server_secret.decode() not in repr(a) and a.client_secret.decode() not in repr(a)
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ValueError, match="at least 32"):
        link_security.read_cluster_secret(tmp_path / "short")


@pytest.mark.parametrize("text, why", [
    ("a" * 64, "repeats a pattern of 1"),
    ("0123456789abcdef" * 4, "repeats a pattern of 16"),
    ("passwordpassword" * 2 + "pass", "repeats a pattern of 8"),
    ("a" * 16 + "b" * 16 + "c" * 8, "bits, fewer than 80"),
])
def test_a_weak_cluster_secret_is_refused_naming_the_override(tmp_path, caplog, text, why):
    path = tmp_path / "s"
    path.write_text(text + "\n")
    path.chmod(0o600)
    with pytest.raises(ValueError, match=why) as err:
        link_security.read_cluster_secret(path)
    assert "--allow-insecure-cluster-secret" in str(err.value)
    assert "PAGODA_ALLOW_INSECURE_CLUSTER_SECRET" in str(err.value)
    assert link_security.read_cluster_secret(path, allow_insecure=True) == text.encode()
    assert "INSECURE" in caplog.text


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o640])
def test_a_cluster_secret_other_users_may_read_is_refused(tmp_path, monkeypatch, mode):
    path = link_security.make_cluster_secret(tmp_path / "s")
    path.chmod(mode)
    monkeypatch.setattr(link_security, "_private_group", lambda gid: False)  # a group others are in
    with pytest.raises(ValueError, match=f"may read or write it \\(mode {mode:o}\\).*--allow-insecure-cluster-secret"):
        link_security.read_cluster_secret(path)
    assert len(link_security.read_cluster_secret(path, allow_insecure=True)) == 64
    if not mode & 0o007:  # the group's bits only: fine for a group nobody else is in (a pod's fsGroup)
        monkeypatch.setattr(link_security, "_private_group", lambda gid: True)
        assert len(link_security.read_cluster_secret(path)) == 64


def test_random_secrets_pass_even_the_shortest():
    rng = random.Random(43)
    for num_bytes in (16, 24, 32):  # 32 hex digits (the least accepted) up to make_cluster_secret's 64
        texts = (rng.randbytes(num_bytes).hex() for _ in range(20_000))
        weak = [text for text in texts if link_security.secret_weakness(text)]
        assert not weak, weak[:3]


@pytest.mark.parametrize(
    "endpoint, loopback",
    [
        ("tcp://127.0.0.1:5557", True), ("tcp://127.0.0.2:1", True), ("tcp://localhost:5557", True),
        ("tcp://[::1]:5557", True), ("ipc:///tmp/x", True), ("tcp://0.0.0.0:5557", False),
        ("tcp://*:5557", False), ("tcp://10.0.0.3:5557", False), ("tcp://eth0:5557", False), ("tcp://[::]:1", False),
    ],
)
def test_loopback_endpoints(endpoint, loopback):
    assert link_security.is_loopback_endpoint(endpoint) is loopback


def test_without_a_secret_file_the_link_uses_a_private_per_user_secret(tmp_path, monkeypatch, caplog):
    """Issue #24: the default link is CURVE; an executor on the host finds the scheduler's secret."""
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    path = link_security.default_secret_path()
    assert not path.exists()
    scheduler = link_security.scheduler_link_keys(None, insecure=False, bind="tcp://127.0.0.1:5557")
    assert path.exists() and os.stat(path).st_mode & 0o777 == 0o600
    assert link_security.scheduler_link_keys(None, insecure=False, bind="tcp://0.0.0.0:5557") == scheduler  # made once
    assert link_security.executor_link_keys(None, insecure=False, endpoint="tcp://127.0.0.1:5557") == scheduler
    assert link_security.executor_link_keys(None, insecure=False, endpoint="tcp://sched-host:5557") == scheduler
    os.chmod(path, 0o644)  # readable by others: not a secret any more, and not used
    with pytest.raises(ValueError, match="not private"):
        link_security.scheduler_link_keys(None, insecure=False, bind="tcp://127.0.0.1:5557")
    with pytest.raises(ValueError, match="not private"):
        link_security.executor_link_keys(None, insecure=False, endpoint="tcp://127.0.0.1:5557")
    given = link_security.make_cluster_secret(tmp_path / "given")
    keys = link_security.derive_link_keys(link_security.read_cluster_secret(given))
    assert link_security.scheduler_link_keys(str(given), insecure=False, bind="tcp://0.0.0.0:1") == keys
    assert link_security.executor_link_keys(str(given), insecure=False, endpoint="tcp://h:1") == keys
    caplog.clear()
    assert link_security.scheduler_link_keys(None, insecure=True, bind="tcp://127.0.0.1:5557") is None
    assert link_security.executor_link_keys(None, insecure=True, endpoint="tcp://127.0.0.1:5557") is None
    assert caplog.text.count("INSECURE") == 2 and "--insecure-executor-link" in caplog.text


def test_an_executor_waits_for_a_local_schedulers_secret_and_a_remote_one_needs_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="--cluster-secret-file"):  # another host's scheduler: its secret is not here
        link_security.executor_link_keys(None, insecure=False, endpoint="tcp://10.0.0.3:5557")
    with pytest.raises(ValueError, match="no scheduler made"):
        link_security.executor_link_keys(None, insecure=False, endpoint="tcp://127.0.0.1:5557", wait_s=0.2, poll_s=0.05)
    maker = threading.Timer(0.3, link_security.ensure_default_secret)
    maker.start()
    keys = link_security.executor_link_keys(None, insecure=False, endpoint="tcp://127.0.0.1:5557", wait_s=30, poll_s=0.05)
    maker.join()
    assert keys == link_security.derive_link_keys(link_security.read_private_secret(link_security.default_secret_path()))


def test_racing_secret_makers_agree_on_one_file(tmp_path):
    paths, errors = [], []

    def make():
        try:
            paths.append(link_security.make_cluster_secret(tmp_path / "s"))
        except FileExistsError:
            errors.append(1)

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(paths) == 1 and len(errors) == 7
    assert os.listdir(tmp_path) == ["s"]  # no temporary file left behind
    assert len(link_security.read_cluster_secret(tmp_path / "s")) == 64


def test_api_key_file_and_tenants(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\n\nkey-aaaaaaaaaaaaaaaa team-a\nkey-bbbbbbbbbbbbbbbb team-a  # two keys, one tenant\nkey-cccccccccccccccc\n")
    keys = load_api_keys(["key-dddddddddddddddd"], str(path))
    tenants = {k.key.decode(): k.tenant for k in keys}
    assert tenants["key-aaaaaaaaaaaaaaaa"] == tenants["key-bbbbbbbbbbbbbbbb"] == "team-a"
    lone = {tenants["key-cccccccccccccccc"], tenants["key-dddddddddddddddd"]}
    assert len(lone) == 2 and all("cccc" not in t and "dddd" not in t for t in lone)  # own tenants, keys not shown
    interceptor = ApiKeyInterceptor(keys)
    assert interceptor.tenant_of(b"key-aaaaaaaaaaaaaaaa") == "team-a"
    assert interceptor.tenant_of(b"key-aaaaaaaaaaaaaaa") is None and interceptor.tenant_of(None) is None
    assert interceptor.tenant_of(b"") is None
    path.write_text("short\n")
    with pytest.raises(ValueError, match="16 characters"):
        load_api_keys(None, str(path))
    path.write_text("key-aaaaaaaaaaaaaaaa a b\n")
    with pytest.raises(ValueError, match=":1: expected"):
        load_api_keys(None, str(path))


def test_only_a_key_marked_admin_in_the_file_is_an_admin(tmp_path):
    path = tmp_path / "keys"
    path.write_text("key-aaaaaaaaaaaaaaaa ops admin\nkey-bbbbbbbbbbbbbbbb admin\nkey-cccccccccccccccc\n")
    keys = {k.key: k for k in load_api_keys(["key-dddddddddddddddd"], str(path))}
    assert keys[b"key-aaaaaaaaaaaaaaaa"].admin and keys[b"key-aaaaaaaaaaaaaaaa"].tenant == "ops"
    assert not keys[b"key-bbbbbbbbbbbbbbbb"].admin and keys[b"key-bbbbbbbbbbbbbbbb"].tenant == "admin"  # a tenant's name
    assert not keys[b"key-cccccccccccccccc"].admin and not keys[b"key-dddddddddddddddd"].admin
    assert ApiKeyInterceptor(list(keys.values())).key_of(b"key-aaaaaaaaaaaaaaaa").admin
    path.write_text("key-aaaaaaaaaaaaaaaa ops root\n")
    with pytest.raises(ValueError, match="key tenant admin"):
        load_api_keys(None, str(path))


def test_salts_are_unambiguous_and_change_every_block_key():
    assert prefix_cache_salt("", "") == ""
    assert prefix_cache_salt("ab", "c") != prefix_cache_salt("a", "bc") != prefix_cache_salt("", "abc")
    assert root_hash("") == ROOT_HASH and root_hash("a") != root_hash("b")
    tokens = list(range(64))
    plain, salted = block_hashes_of(tokens, 16), block_hashes_of(tokens, 16, "t")
    assert all(p.hash_value != s.hash_value for p, s in zip(plain, salted))
    assert block_hashes_of(tokens, 16, "t") == salted


def test_prefix_hits_only_within_one_salt():
    manager = KVCacheManager(block_size=4, num_blocks=32, enable_prefix_caching=True)
    first = Request("a", list(range(13)), cache_salt="tenant-a")
    blocks, _ = manager.get_computed_blocks(first)
    assert manager.allocate_slots(first, 13, blocks) is not None
    first.num_computed_tokens = 13
    manager.cache_full_blocks(first)
    same = Request("b", list(range(13)), cache_salt="tenant-a")
    other = Request("c", list(range(13)), cache_salt="tenant-b")
    assert manager.get_computed_blocks(same)[1] == 12
    assert manager.get_computed_blocks(other)[1] == 0
    assert manager.num_prefix_cached_tokens(list(range(13)), "tenant-a") == 12
    assert manager.num_prefix_cached_tokens(list(range(13)), "tenant-b") == 0
    assert manager.num_prefix_cached_tokens(list(range(13))) == 0


def test_sampled_values_are_checked():
    ok = StepResult(1, [SampledToken("r", 5, -0.5, [(5, -0.5), (6, -math.inf)])])
    assert sampled_values_problem(ok, 10) == ""
    for bad in (
        SampledToken("r", 10), SampledToken("r", -1), SampledToken("r", 1, math.nan), SampledToken("r", 1, math.inf),
        SampledToken("r", 1, 3.0), SampledToken("r", 1, -0.1, [(99, -1.0)]), SampledToken("r", 1, -0.1, [(1, math.nan)]),
    ):
        assert sampled_values_problem(StepResult(1, [bad]), 10), bad


def test_a_huge_pool_makes_no_block_until_one_is_used():
    pool = BlockPool(3_000_000, enable_caching=True)
    assert len(pool.blocks) == 1 and pool.num_free_blocks == pool.num_total_blocks == 2_999_999
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [1, 2, 3] and len(pool.blocks) == 4
    pool.free_blocks(reversed(got))
    assert pool.num_free_blocks == 2_999_999
    small = BlockPool(6, enable_caching=False)
    small.get_new_blocks(2)
    assert [b.block_id for b in small.free_queue()] == [3, 4, 5]  # fresh blocks stay at the head, in order
    small.check_integrity()


def test_a_result_is_counted_before_it_is_converted():
    """Issue #24: 200,000 top logprobs for a request that asked for 2 are refused on their count."""
    asked = {"a": 2, "b": 0}

    def requested(step_id, req_id):
        return asked.get(req_id) if step_id == 7 else None

    def problem(result: StepResult, scheduled=frozenset({"a", "b"}), per_request=1) -> str:
        return result_shape_problem(wire.result_to_proto(result), scheduled, per_request, requested)

    top = [(i, -1.0) for i in range(2)]
    assert problem(StepResult(7, [SampledToken("a", 1, -0.1, top), SampledToken("b", 2, -0.1)])) == ""
    flood = [(i, -1.0) for i in range(200_000)]
    assert "200000 top logprobs for 'a', which asked for 2" in problem(StepResult(7, [SampledToken("a", 1, -0.1, flood)]))
    assert "which asked for 0" in problem(StepResult(7, [SampledToken("b", 1, -0.1, top)]))
    assert "unscheduled request 'c'" in problem(StepResult(7, [SampledToken("c", 1)]))
    three = [SampledToken("a", 1), SampledToken("a", 2), SampledToken("b", 3)]
    assert "3 tokens" in problem(StepResult(7, three[:2] + three[1:2]))  # more than one a request
    assert problem(StepResult(7, three), per_request=2) == ""  # a drafts' step: 1 + 1 draft each
    assert "errors" in problem(StepResult(7, errors=[RequestError("a", "x")] * 3))


def test_the_largest_legal_executor_message_fits_the_link_limit():
    """ZMQ_MAXMSGSIZE is the size of the largest honest result, every field at its widest."""
    rows = 3
    req_id = "\U0010ffff" * (MAX_CORE_REQ_ID_BYTES // 4)
    top = [(2**32 - 1, -1e-30)] * MAX_TOP_LOGPROBS_PER_TOKEN
    widest = StepResult(
        2**64 - 1,
        [SampledToken(req_id, 2**32 - 1, -3.4e38, top) for _ in range(rows)],
        [RequestError(req_id, "\U0010ffff" * MAX_ERROR_MESSAGE_CHARS) for _ in range(rows)],
    )
    message = wire.result_to_proto(widest)
    message.error = "\U0010ffff" * MAX_ERROR_MESSAGE_CHARS
    size = xpb.ExecutorMessage(step_result=message).ByteSize()
    assert size <= max_executor_message_bytes(rows) < size + 64
    assert max_executor_message_bytes(2048) < 64 * 2**20  # the 1 GB message of issue #24 is refused


def test_a_reachable_grpc_port_without_an_api_key_is_warned_about(tmp_path, monkeypatch, caplog):
    from scheduler_svc.__main__ import parse_args, security_settings

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    for host, warned in (("127.0.0.1", False), ("localhost", False), ("0.0.0.0", True), ("::", True), ("10.1.2.3", True)):
        caplog.clear()
        security_settings(parse_args(["--host", host]))
        assert ("--api-key" in caplog.text and f"--host {host}" in caplog.text) is warned, (host, caplog.text)
    caplog.clear()
    security_settings(parse_args(["--host", "0.0.0.0", "--api-key", "k" * 16]))
    assert "--api-key" not in caplog.text


def test_tenants_share_the_queue_by_default_once_there_are_two():
    from scheduler_svc.__main__ import requests_per_tenant

    one, two = load_api_keys(["a" * 16], None), load_api_keys(["a" * 16, "b" * 16], None)
    assert requests_per_tenant(None, [], 1024) == 0 and requests_per_tenant(None, one, 1024) == 0
    assert requests_per_tenant(None, two, 1024) == 512
    assert requests_per_tenant(0, two, 1024) == 0 and requests_per_tenant(3, one, 1024) == 3
