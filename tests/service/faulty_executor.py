"""`python -m tests.service.faulty_executor --fault nan|hang ...`: executor_svc with one fault, for tests.

    nan    a request whose prompt starts with POISON_PROMPT gets a row of NaN logits (from its
           first sampled token on); every other request is computed as usual
    hang   registers and heartbeats, but never answers a step that schedules any token
    crash  the process dies (exit 3) on a step that holds a request starting with POISON_PROMPT
    raise  such a step raises: the executor answers it with StepResult.error and lives on

Everything else (flags, handshake, heartbeats) is the real executor's.
"""

from __future__ import annotations

import sys
import threading

POISON_PROMPT = [1, 4242, 4243, 4244]


def _nan_rows() -> None:
    from executor_svc.model_runner import ModelRunner

    sample = ModelRunner.sample

    def poisoned(self, logits, req_ids):
        for row, req_id in enumerate(req_ids):
            if self.requests[req_id].token_ids[: len(POISON_PROMPT)] == POISON_PROMPT:
                logits[row] = float("nan")
        return sample(self, logits, req_ids)

    ModelRunner.sample = poisoned


def _poisoned(runner, req_ids) -> bool:
    return any(runner.requests[r].token_ids[: len(POISON_PROMPT)] == POISON_PROMPT for r in req_ids)


def _fail_on_poison(fail) -> None:
    from executor_svc.model_runner import ModelRunner

    execute = ModelRunner.execute

    def failing(self, plan):
        ids = [n.req_id for n in plan.new_requests if n.token_ids[: len(POISON_PROMPT)] == POISON_PROMPT]
        if ids or _poisoned(self, [r for r in plan.num_scheduled_tokens if r in self.requests]):
            fail()
        return execute(self, plan)

    ModelRunner.execute = failing


def _crash() -> None:
    import os

    _fail_on_poison(lambda: os._exit(3))


def _raise() -> None:
    def fail():
        raise RuntimeError("poisoned step")

    _fail_on_poison(fail)


def _hang() -> None:
    from executor_svc.model_runner import ModelRunner

    execute = ModelRunner.execute

    def hung(self, plan):
        if plan.total_num_scheduled_tokens:
            threading.Event().wait()  # forever; the heartbeat thread goes on
        return execute(self, plan)

    ModelRunner.execute = hung


def main() -> int:
    argv = sys.argv[1:]
    i = argv.index("--fault")
    fault = argv[i + 1]
    del argv[i : i + 2]
    {"nan": _nan_rows, "hang": _hang, "crash": _crash, "raise": _raise}[fault]()
    from executor_svc.__main__ import main as executor_main

    return executor_main(argv)


if __name__ == "__main__":
    sys.exit(main())
