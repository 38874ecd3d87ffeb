"""One bad request fails alone (issue #16): NaN logits, a hung executor, a poison pill.

The faults come from `tests.service.faulty_executor` (the real executor with one fault);
every healthy request is checked token for token against transformers on the same tiny model.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.service.faulty_executor import POISON_PROMPT
from tests.service.harness import Service, collect, greedy_request, hf_greedy
from tests.service.test_tiny_models import build_tiny

PROMPTS = [[1, 300 + 11 * i, 17, 900 + i, 5] for i in range(4)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp("tiny-faults")
    model = build_tiny("llama", path, default_model_dir, shard=False)
    return path, {tuple(p): hf_greedy(model, p, MAX_TOKENS, ignore_eos=True) for p in PROMPTS}


def _generate(svc, prompt):
    try:
        result = collect(svc.stub.Generate(greedy_request(prompt_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True), timeout=180))
        return grpc.StatusCode.OK, result["outputs"][0]["token_ids"]
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


def _all_at_once(svc, prompts):
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _generate(svc, p), prompts))


def test_nan_logits_end_that_request_with_internal_and_spare_its_batch(tiny):
    path, reference = tiny
    with Service(model=str(path), executor_args=["--num-kv-blocks", "128"], num_executors=0) as svc:
        svc.add_executor(["--fault", "nan"], module="tests.service.faulty_executor")
        svc.wait_serving(1)
        (poison_code, poison_details), *healthy = _all_at_once(svc, [POISON_PROMPT + [7, 8], *PROMPTS])
        assert poison_code == grpc.StatusCode.INTERNAL and "non-finite" in poison_details, poison_details
        for prompt, (code, tokens) in zip(PROMPTS, healthy):
            assert code == grpc.StatusCode.OK and tokens == reference[tuple(prompt)]
        info = svc.wait_all_blocks_free()
        assert len(info.executors) == 1 and all(e.num_free_blocks == e.num_total_blocks for e in info.executors)
        assert svc.executors[0].poll() is None


def test_a_hung_executor_loses_its_requests_to_another_after_the_step_timeout(tiny):
    path, reference = tiny
    with Service(model=str(path), scheduler_args=["--step-timeout", "3"], executor_args=["--num-kv-blocks", "128"], num_executors=0) as svc:
        svc.add_executor()
        svc.wait_serving(1)
        svc.add_executor(["--fault", "hang"], module="tests.service.faulty_executor")
        svc.wait_serving(2)
        results = _all_at_once(svc, PROMPTS)
        for prompt, (code, tokens) in zip(PROMPTS, results):
            assert code == grpc.StatusCode.OK and tokens == reference[tuple(prompt)], (code, tokens)
        assert "step timeout" in (svc.logdir / "scheduler.log").read_text()
        assert len(svc.server_info().executors) == 1


@pytest.mark.parametrize("fault", ["crash", "raise"])
def test_a_request_that_brought_down_two_executors_ends_with_internal(tiny, fault):
    """crash: the executor process dies; raise: its step fails (StepResult.error) and it registers again."""
    path, reference = tiny
    with Service(model=str(path), executor_args=["--num-kv-blocks", "128"], num_executors=0) as svc:
        for _ in range(3):
            svc.add_executor(["--fault", fault], module="tests.service.faulty_executor")
        svc.wait_serving(3)
        code, details = _generate(svc, POISON_PROMPT + [9])
        assert code == grpc.StatusCode.INTERNAL and "brought down 2 executors" in details, details
        alive = sum(p.poll() is None for p in svc.executors)
        assert alive == (1 if fault == "crash" else 3)  # with crash, the third is never tried
        svc.wait_serving(3 if fault == "raise" else 1)
        for prompt, (code, tokens) in zip(PROMPTS, _all_at_once(svc, PROMPTS)):
            assert code == grpc.StatusCode.OK and tokens == reference[tuple(prompt)]
