"""What the scheduler checks of an executor's sampled values before any token reaches a stream.

An executor is trusted with the KV cache, not with the streams' contents. The core
scheduler already refuses a result that does not fit its plan (wrong step id, a token
for a request the step does not sample, tokens for one request beyond its verified drafts, a missing token:
`Scheduler.update_from_output` raises ValueError, changing nothing); this adds the values:
token ids inside the vocabulary and a sampled token's logprob a finite number <= 0. Either kind of
violation ends that executor's session, and its requests resume elsewhere from the
tokens accepted so far (the engine's `_kill`). Pure function, no I/O.
"""

from __future__ import annotations

import math

from pagoda.step import StepResult

# Sampled logprobs are log-softmax values; float32 rounding can put the best one a hair above 0.
_LOGPROB_SLACK = 1e-3


def sampled_values_problem(result: StepResult, vocab_size: int) -> str:
    """Why the values in `result` cannot come from a model with `vocab_size` tokens ("" when they can)."""
    for sampled in result.sampled:
        req = sampled.req_id
        if not 0 <= sampled.token_id < vocab_size:
            return f"step {result.step_id}: token id {sampled.token_id} for {req!r} is outside the vocabulary ({vocab_size})"
        if not _is_logprob(sampled.logprob):
            return f"step {result.step_id}: logprob {sampled.logprob} for {req!r} is not a log-probability"
        for token_id, logprob in sampled.top_logprobs:
            # -inf is a real value here: a token masked out (min_tokens, logit_bias) may rank in the top list
            if not 0 <= token_id < vocab_size or not (logprob == -math.inf or _is_logprob(logprob)):
                return f"step {result.step_id}: top logprob ({token_id}, {logprob}) for {req!r} is out of range"
    return ""


def _is_logprob(value: float) -> bool:
    return math.isfinite(value) and value <= _LOGPROB_SLACK
