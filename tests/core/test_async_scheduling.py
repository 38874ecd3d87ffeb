"""Async scheduling: the core driven with one step planned ahead of the last result.

The same random histories as `test_scheduler_properties` (n siblings, prefix hits,
preemption, aborts mid-step, executors dying mid-step, requests handed back to the
engine's queue), but every step is planned before the previous result is applied.
After every rule the scheduler's invariants hold, the executor is ahead by exactly the
tokens in flight, and every request that stops on its own ends with exactly the tokens
a direct computation gives: placeholders never change the output.
"""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from scheduler_svc.core import FinishReason, Scheduler, SchedulerConfig

from .fake_executor import AheadDriver, FakeExecutor, assert_views_agree, make_request
from .test_scheduler_properties import VOCAB_SIZE, SchedulerMachine, check_outputs, configs


class AheadSchedulerMachine(SchedulerMachine):
    @initialize(config=configs, data=st.data())
    def start(self, config: SchedulerConfig, data: st.DataObject) -> None:
        super().start(config, data)
        self.driver = AheadDriver(self.scheduler, self.executor)

    @rule(num_steps=st.integers(1, 4))
    def run_steps(self, num_steps: int) -> None:
        for _ in range(num_steps):
            for update in self.driver.step():
                request = next(r for r in self.requests if r.req_id == update.req_id)
                assert request.output_token_ids[-1] == update.sampled.token_id
                assert (update.finish_reason is not None) == request.is_finished

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort_while_a_step_runs(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.requests))
        self.driver.step()
        self.scheduler.finish_requests([request.req_id], FinishReason.ABORTED)
        updates = self.driver.step()
        assert request.req_id not in {update.req_id for update in updates}

    @rule()
    def hand_back_movable(self) -> None:
        """Late binding: preempted requests go back to the engine's queue (here: straight back)."""
        movable = self.scheduler.take_movable()
        for request in movable:
            assert request.num_computed_tokens == 0 and request.num_output_placeholders == 0
            assert not any(self.scheduler.kv_cache_manager.block_ids(request.req_id))
        for request in movable:
            self.scheduler.add_requests([request])

    @rule(when=st.sampled_from(["alive", "alive", "alive", "between steps", "mid-step"]))
    def drain_and_move(self, when: str) -> None:
        if when == "mid-step":
            self.driver.step()  # its result, and the one before it, never arrive
        super().drain_and_move("between steps" if when == "mid-step" else when)
        if when != "alive":
            self.driver = AheadDriver(self.scheduler, self.executor)

    @invariant()
    def views_agree(self) -> None:
        if hasattr(self, "driver"):
            assert_views_agree(self.scheduler, self.executor)
            assert self.scheduler.num_steps_in_flight <= 2

    def teardown(self) -> None:
        if not hasattr(self, "driver"):
            return
        self.driver.run_to_completion(max_steps=5_000)
        stats = self.scheduler.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        check_outputs(self.requests, self.config.max_seq_len)


TestAheadSchedulerMachine = AheadSchedulerMachine.TestCase
TestAheadSchedulerMachine.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestAheadSchedulerMachine.pytestmark = [pytest.mark.slow]  # hundreds of random programs: make test, not make test-fast


def test_a_decode_is_planned_while_its_token_is_in_flight():
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_num_batched_tokens=64))
    executor = FakeExecutor(4, 16, VOCAB_SIZE)
    request = make_request("a", [1, 2, 3, 4, 5], max_tokens=3)
    scheduler.add_requests([request])
    driver = AheadDriver(scheduler, executor)
    driver.step()  # prefill: 5 tokens, one token in flight
    assert request.num_computed_tokens == 5 and request.num_output_placeholders == 1
    plan = scheduler.schedule()  # feeds the placeholder before its value is known
    assert plan.num_scheduled_tokens == {"a": 1} and request.num_output_placeholders == 2
    driver.in_flight.append((plan, executor.execute(plan)))
    driver.apply_oldest()
    assert request.num_output_tokens == 1 and request.num_output_placeholders == 1
    # 1 token out + 1 in flight < max_tokens 3: one more is planned; then 3 are accounted for
    assert scheduler.schedule().num_scheduled_tokens == {"a": 1}
    assert scheduler.schedule().num_scheduled_tokens == {}
