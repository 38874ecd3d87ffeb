"""A request its executor fails alone (StepResult.errors) gets no token; the rest go on (issue #16).

With one step planned ahead, the failed request is already in the next plan: the executor
reports it again there, and the core accepts both results without the missing tokens.
"""

from collections import deque

from pagoda.step import RequestError
from scheduler_svc.core import FinishReason, Scheduler, SchedulerConfig

from .fake_executor import FakeExecutor, make_request, reference_output


def test_a_failed_request_gets_no_token_and_the_others_are_unchanged():
    config = SchedulerConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    scheduler, executor = Scheduler(config), FakeExecutor(4, 64)
    requests = [make_request(f"r{i}", [1 + i, 2, 3, 4, 5], max_tokens=8) for i in range(3)]
    for request in requests:
        scheduler.add_requests([request])
    in_flight, failed, tokens_of_r1_after_failure = deque(), False, 0
    for _ in range(200):
        if not scheduler.has_unfinished() and not in_flight:
            break
        plan = scheduler.schedule()
        result = executor.execute(plan)
        if (plan.step_id >= 3 or failed) and "r1" in plan.num_scheduled_tokens:  # r1 fails from step 3 on
            result.sampled = [t for t in result.sampled if t.req_id != "r1"]
            result.errors = [RequestError("r1", "the model produced non-finite logits (NaN or Inf)")]
            failed = True
        in_flight.append((plan, result))
        if len(in_flight) > 1 or not scheduler.has_unfinished():
            plan, result = in_flight.popleft()
            updates = scheduler.update_from_output(plan, result)
            tokens_of_r1_after_failure += sum(1 for u in updates if u.req_id == "r1" and plan.step_id >= 3)
            if result.errors:  # as the engine: its owner ends it
                scheduler.finish_requests({"r1"}, FinishReason.ABORTED)
            scheduler.check_integrity()
    assert failed and tokens_of_r1_after_failure == 0
    for request in (requests[0], requests[2]):
        assert request.output_token_ids == reference_output(request, 64)
    assert not scheduler.has_unfinished() and scheduler.stats().num_free_blocks == scheduler.stats().num_total_blocks
