"""The 3-minute soak in CI (bench/soak.py): mixed hostile load and an executor restart, then no leaks."""

from __future__ import annotations

from bench.soak import report_table, run_soak


def test_three_minute_soak_leaks_no_block_and_has_no_unexpected_status():
    report = run_soak(minutes=3, clients=4, sample_every=5.0)
    print(report_table(report))
    assert report["leaked_blocks"] == 0
    assert report["unexpected"] == []
    assert report["process_deaths"] == []
    assert report["executors_at_end"] == 2  # the survivor and the executor that replaced the killed one
    assert sum(sum(c.values()) for c in report["statuses"].values()) > 100
    tasks = [v for _, v in report["samples"]["asyncio_tasks"]]
    assert tasks and tasks[-1] <= tasks[0] + 8  # idle at the end: no task left behind per request
