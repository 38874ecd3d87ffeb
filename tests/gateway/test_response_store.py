"""The stored responses of /v1/responses, without a service: per tenant, kept across reopening the
file, and bounded by count and age."""

from __future__ import annotations

import time

import pytest

from gateway_svc.response_store import ResponseStore, tenant_of

HISTORY = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def test_a_response_is_its_tenants_only_and_survives_reopening(tmp_path):
    a, b = tenant_of("key-a"), tenant_of("key-b")
    assert a != b and "key-a" not in a
    store = ResponseStore(tmp_path / "r.sqlite3")
    store.put(a, {"id": "resp_1", "output": []}, HISTORY)
    assert store.get(b, "resp_1") is None and not store.delete(b, "resp_1")
    store.close()
    again = ResponseStore(tmp_path / "r.sqlite3")
    stored = again.get(a, "resp_1")
    assert (stored.response, stored.history) == ({"id": "resp_1", "output": []}, HISTORY)
    assert again.delete(a, "resp_1") and again.get(a, "resp_1") is None and len(again) == 0


def test_the_oldest_go_past_the_count_and_none_outlives_the_age(tmp_path):
    store = ResponseStore(tmp_path / "r.sqlite3", max_count=3)
    for i in range(5):
        store.put(tenant_of(None), {"id": f"resp_{i}"}, [])
    assert [store.get(tenant_of(None), f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    brief = ResponseStore(tmp_path / "brief.sqlite3", max_age_s=0.2)
    brief.put(tenant_of(None), {"id": "resp_old"}, [])
    assert brief.get(tenant_of(None), "resp_old") is not None
    time.sleep(0.3)
    assert brief.get(tenant_of(None), "resp_old") is None
    brief.put(tenant_of(None), {"id": "resp_new"}, [])
    assert len(brief) == 1  # the expired one deleted on the next write


def test_retention_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        ResponseStore(tmp_path / "r.sqlite3", max_count=0)
    with pytest.raises(ValueError):
        ResponseStore(tmp_path / "r.sqlite3", max_age_s=0)
