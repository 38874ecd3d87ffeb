"""EngineConfig: the step budget by executor device, and its validation."""

from __future__ import annotations

import pytest

from scheduler_svc.engine import DEFAULT_CPU_STEP_BUDGET, DEFAULT_GPU_STEP_BUDGET, EngineConfig


def test_step_budget_by_device_unless_given():
    auto = EngineConfig(model_fingerprint="x")
    assert auto.step_budget("cpu") == DEFAULT_CPU_STEP_BUDGET == 512
    assert auto.step_budget("cuda") == auto.step_budget("cuda:3") == DEFAULT_GPU_STEP_BUDGET == 2048
    given = EngineConfig(model_fingerprint="x", max_num_batched_tokens=64)
    assert given.step_budget("cpu") == given.step_budget("cuda:0") == 64


def test_budget_must_be_positive():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model_fingerprint="x", max_num_batched_tokens=0)


def test_flag_default_and_env(monkeypatch):
    from scheduler_svc.__main__ import parse_args

    assert parse_args([]).max_num_batched_tokens is None
    assert parse_args(["--max-num-batched-tokens", "256"]).max_num_batched_tokens == 256
    monkeypatch.setenv("PAGODA_MAX_NUM_BATCHED_TOKENS", "1024")
    assert parse_args([]).max_num_batched_tokens == 1024
