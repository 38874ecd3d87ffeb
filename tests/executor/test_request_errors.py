"""One bad request fails alone on the executor: a per-request error, the rest of the batch unchanged."""

from __future__ import annotations

import pytest
import torch

from executor_svc.model_runner import ModelRunner
from executor_svc.sampler import Sampler, SamplingRow
from pagoda import wire
from pagoda.step import RequestError, SamplingParams, StepPlan, StepResult
from tests.executor.conftest import TINY_VOCAB
from tests.executor.plans import GREEDY, PlanBuilder, record_sampled_rows, run_to_completion

PROMPTS = {"a": list(range(10, 30)), "bad": list(range(40, 47)), "c": list(range(100, 133))}


def _run(runner: ModelRunner, poison: set[str]) -> tuple[dict[str, list[int]], list[RequestError]]:
    """Greedy run of PROMPTS; the logits of the requests in `poison` become NaN from their 3rd token on."""
    builder = PlanBuilder(num_blocks=64, seed=1)
    for req_id, prompt in PROMPTS.items():
        builder.add(req_id, prompt, 8, GREEDY)
    errors: list[RequestError] = []
    compute_logits, prepare_inputs = runner.model.compute_logits, runner.prepare_inputs
    order = record_sampled_rows(runner)

    def poisoned(hidden, residual, indices=None):
        logits = compute_logits(hidden, residual, indices)
        for row, req_id in enumerate(order):
            if req_id in poison and len(builder.outputs[req_id]) >= 2:
                logits[row] = float("nan")
        return logits

    def step(plan: StepPlan) -> StepResult:
        result = runner.execute(plan)
        errors.extend(result.errors)
        for error in result.errors:  # the scheduler ends such a request
            del plan.num_scheduled_tokens[error.req_id]
            builder._finish(error.req_id)
        return result

    runner.model.compute_logits = poisoned
    try:
        outputs = run_to_completion(runner, builder, on_step=step)
    finally:
        runner.model.compute_logits, runner.prepare_inputs = compute_logits, prepare_inputs
    return outputs, errors


def test_nan_logits_fail_their_request_alone(tiny_model_dirs):
    runner = ModelRunner(tiny_model_dirs["llama"], block_size=16, num_kv_blocks=64)
    clean, no_errors = _run(runner, set())
    assert no_errors == []
    outputs, errors = _run(runner, {"bad"})
    assert [e.req_id for e in errors] == ["bad"]
    assert "non-finite" in errors[0].message
    assert outputs["bad"] == clean["bad"][:2]  # no token 0 in place of the NaN row
    assert outputs["a"] == clean["a"] and outputs["c"] == clean["c"]


def test_a_sampler_failure_on_one_row_fails_that_row_alone(tiny_model_dirs, monkeypatch):
    runner = ModelRunner(tiny_model_dirs["qwen2"], block_size=16, num_kv_blocks=64)
    clean, _ = _run(runner, set())
    original = Sampler.__call__

    def fragile(self, logits, rows, token_bitmask=None):  # fails on any batch holding the request with top_k=7
        if any(r.params.top_k == 7 for r in rows):
            raise RuntimeError("kernel refused top_k=7")
        return original(self, logits, rows, token_bitmask)

    monkeypatch.setattr(Sampler, "__call__", fragile)
    builder = PlanBuilder(num_blocks=64, seed=2)
    for req_id, prompt in PROMPTS.items():
        builder.add(req_id, prompt, 8, SamplingParams(temperature=0.0, top_k=7) if req_id == "bad" else GREEDY)
    plan = builder.next_plan()
    result = runner.execute(plan)
    assert [e.req_id for e in result.errors] == ["bad"] and "top_k=7" in result.errors[0].message
    assert {t.req_id: t.token_id for t in result.sampled} == {"a": clean["a"][0], "c": clean["c"][0]}
    runner.reset()


def test_top_logprobs_beyond_the_vocabulary_are_clamped():
    """A beam with stop_token_ids listing the whole vocabulary asks for more candidates than exist."""
    logits = torch.randn(2, TINY_VOCAB)
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=TINY_VOCAB + 16), [1], 1)] * 2
    out = Sampler()(logits, rows)
    assert len(out.top_logprobs[0]) == TINY_VOCAB
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1e-30, 1e-7])
def test_a_tiny_temperature_is_greedy(temperature):
    logits = torch.randn(3, TINY_VOCAB) * 30
    rows = [SamplingRow(SamplingParams(temperature=temperature), [1], 1)] * 3
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_request_errors_round_trip_on_the_wire():
    result = StepResult(step_id=3, errors=[RequestError("r1", "the model produced non-finite logits")])
    assert wire.result_from_proto(wire.result_to_proto(result)) == result


def test_a_failed_request_scheduled_again_gets_its_error_again(tiny_model_dirs):
    """One step planned ahead: the scheduler schedules it once more before it learns of the failure."""
    from pagoda.step import CachedRequestData

    runner = ModelRunner(tiny_model_dirs["llama"], block_size=16, num_kv_blocks=64)
    builder = PlanBuilder(num_blocks=64, seed=3)
    builder.add("ok", PROMPTS["a"], 4, GREEDY)
    builder.add("bad", PROMPTS["bad"], 4, GREEDY)
    plan = builder.next_plan()
    runner.failed["bad"] = "the model produced non-finite logits (NaN or Inf)"  # as if its last step failed
    result = runner.execute(plan)
    assert [e.req_id for e in result.errors] == ["bad"] and [t.req_id for t in result.sampled] == ["ok"]
    again = StepPlan(step_id=plan.step_id + 1, cached_requests=[CachedRequestData("bad", [])], num_scheduled_tokens={"bad": 1, "ok": 1})
    result = runner.execute(again)
    assert [e.req_id for e in result.errors] == ["bad"] and [t.req_id for t in result.sampled] == ["ok"]
    runner.execute(StepPlan(step_id=plan.step_id + 2, finished_req_ids=["bad", "ok"]))
    assert runner.failed == {} and runner.requests == {}


@pytest.mark.parametrize("fault", ["nan", "verify"])
def test_with_drafts_one_bad_request_fails_alone(tiny_model_dirs, monkeypatch, fault):
    """Speculative decoding's path (k + 1 rows per request) isolates a bad request as `sample` does."""
    from executor_svc import model_runner as mr
    from pagoda.step import CachedRequestData, NewRequestData

    def step(runner: ModelRunner) -> StepResult:
        prompts = {"a": PROMPTS["a"], "bad": PROMPTS["bad"], "c": PROMPTS["c"]}
        new = [NewRequestData(r, list(p), len(p), GREEDY, [2 * i + 1, 2 * i + 2, 2 * i + 3], 0) for i, (r, p) in enumerate(prompts.items())]
        runner.execute(StepPlan(step_id=0, new_requests=new, num_scheduled_tokens={r: len(p) - 1 for r, p in prompts.items()}))
        drafts = {"a": [5, 6], "bad": [7], "c": [8, 9, 10]}
        result = runner.execute(StepPlan(
            step_id=1, cached_requests=[CachedRequestData(r, []) for r in prompts],
            num_scheduled_tokens={r: 1 + len(drafts[r]) for r in prompts}, scheduled_spec_decode_tokens=drafts,
        ))
        runner.execute(StepPlan(step_id=2, finished_req_ids=list(prompts)))
        return result

    runner = ModelRunner(tiny_model_dirs["llama"], block_size=16, num_kv_blocks=64)
    clean = step(runner)
    assert clean.errors == []
    if fault == "nan":
        compute_logits = runner.model.compute_logits
        rows = record_sampled_rows(runner)  # a runner of this test alone: nothing to restore

        def poisoned(hidden, residual, indices=None):
            logits = compute_logits(hidden, residual, indices)
            bad = [i for i, r in enumerate(rows) if r == "bad"]
            if bad:
                logits[bad[-1]] = float("nan")  # its bonus row only
            return logits

        monkeypatch.setattr(runner.model, "compute_logits", poisoned)
    else:
        original = mr.verify

        def fragile(sampler, logits, rows, drafts, token_bitmask=None):
            if [7] in drafts:
                raise RuntimeError("verification refused the draft [7]")
            return original(sampler, logits, rows, drafts, token_bitmask)

        monkeypatch.setattr(mr, "verify", fragile)
    result = step(runner)
    assert [e.req_id for e in result.errors] == ["bad"]
    assert ("non-finite" if fault == "nan" else "refused the draft") in result.errors[0].message
    assert [(t.req_id, t.token_id) for t in result.sampled] == [(t.req_id, t.token_id) for t in clean.sampled if t.req_id != "bad"]
    assert runner.failed == {} and runner.requests == {}
