"""Fuzzing in CI: a few hundred hypothesis-generated requests (bench/fuzz.py) on a tiny random model."""

from __future__ import annotations

from bench.fuzz import all_blocks_free, run_fuzz, tiny_model
from tests.service.harness import Service


def test_fuzzed_requests_get_no_unknown_or_internal_status(tmp_path):
    with Service(str(tiny_model(tmp_path)), executor_args=["--num-kv-blocks", "512"]) as svc:
        report = run_fuzz(f"127.0.0.1:{svc.port}", examples=300, timeout_s=2.0, seed=0)
        assert report.examples == 300
        assert report.failures == []
        assert svc.scheduler.poll() is None and all(p.poll() is None for p in svc.executors)
        info = all_blocks_free(svc.stub)
        assert len(info.executors) == 1
        assert all(e.num_free_blocks == e.num_total_blocks for e in info.executors), info
        assert report.statuses["OK"] > 0 and report.statuses["INVALID_ARGUMENT"] > 0
