"""`python -m tests.service.lying_executor --lie MODE --lie-after N [executor flags]`: a real executor that lies.

It runs the model like any executor, then from its N-th step with sampled tokens on it
corrupts every result: MODE `out_of_range` makes a token id >= the vocabulary size,
`unscheduled` adds a token for a request the step does not sample, `top_logprobs` gives a
token 200,000 top logprobs (its request asked for a few). The scheduler must drop it and
finish its requests elsewhere as if nothing had happened (test_security_results.py).
"""

from __future__ import annotations

import argparse
import sys

from executor_svc import __main__ as executor_main
from executor_svc import model_runner
from pagoda.step import SampledToken


def install(mode: str, after: int) -> None:
    honest = model_runner.ModelRunner.execute
    steps = {"with_tokens": 0}

    def execute(self, plan):
        result = honest(self, plan)
        if result.sampled:
            steps["with_tokens"] += 1
            if steps["with_tokens"] >= after:
                if mode == "out_of_range":
                    result.sampled[0].token_id = self.vocab_size + 7
                elif mode == "unscheduled":
                    result.sampled.append(SampledToken(req_id="someone-else", token_id=1))
                elif mode == "top_logprobs":
                    result.sampled[0].top_logprobs = [(i, -20.0) for i in range(200_000)]
                else:
                    raise ValueError(f"unknown mode {mode!r}")
        return result

    model_runner.ModelRunner.execute = execute


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--lie", required=True, choices=["out_of_range", "unscheduled", "top_logprobs"])
    parser.add_argument("--lie-after", type=int, default=1)
    lies, executor_argv = parser.parse_known_args()
    install(lies.lie, lies.lie_after)
    sys.exit(executor_main.main(executor_argv))
