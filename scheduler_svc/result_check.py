"""What the scheduler checks of an executor's sampled values before any token reaches a stream.

An executor is trusted with the KV cache, not with the streams' contents. The link bounds
a message's size (ZMQ_MAXMSGSIZE: `max_executor_message_bytes`); on the message as it came,
`result_shape_problem` counts, before converting anything: no more tokens, errors or top
logprobs than the step and its requests allow. The core scheduler refuses a result that
does not fit its plan (wrong step id, a token for a request the step does not sample,
tokens beyond its verified drafts, a missing token: `Scheduler.update_from_output` raises
ValueError, changing nothing); `sampled_values_problem` checks the values: token ids inside
the vocabulary and a sampled token's logprob a finite number <= 0. Any violation ends that
executor's session, and its requests resume elsewhere from the tokens accepted so far
(`ExecutorPool.reject`). Pure functions, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pagoda.step import MAX_ERROR_MESSAGE_CHARS, StepResult
from pagoda.v1 import executor_pb2 as xpb
from scheduler_svc.validation import MAX_BEAM_WIDTH, MAX_REQUEST_ID_CHARS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS

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


def result_shape_problem(
    msg: xpb.StepResult,
    scheduled: frozenset[str],
    max_tokens_per_request: int,
    requested_top_logprobs: Callable[[int, str], int | None],
) -> str:
    """Why `msg`, as it came off the link, cannot answer a step of `scheduled` requests ("" when it can).

    Counts only, before anything is converted, so that a result stuffed with entries costs
    nothing: at most `max_tokens_per_request` tokens a request (1 + its drafts) and one error
    a request, tokens only for scheduled requests, and no more top logprobs on a token than
    its request asked for (`requested_top_logprobs(step_id, req_id)`).
    """
    step = msg.step_id
    if len(msg.sampled) > len(scheduled) * max_tokens_per_request or len(msg.errors) > len(scheduled):
        return f"step {step}: {len(msg.sampled)} tokens and {len(msg.errors)} errors for {len(scheduled)} scheduled requests"
    for sampled in msg.sampled:
        if sampled.req_id not in scheduled:
            return f"step {step}: token for unscheduled request {sampled.req_id!r}"
        if sampled.top_logprobs:
            asked = requested_top_logprobs(step, sampled.req_id) or 0
            if len(sampled.top_logprobs) > asked:
                return f"step {step}: {len(sampled.top_logprobs)} top logprobs for {sampled.req_id!r}, which asked for {asked}"
    return ""


def _is_logprob(value: float) -> bool:
    return math.isfinite(value) and value <= _LOGPROB_SLACK


# What the largest legal executor message holds, per sampled token and per failed request.
# A core request id is `<i>:<request_id>-<serial>` or `beam<k>:...`: the request id's UTF-8
# (4 bytes a character at most) and a few dozen more. The most top logprobs a token carries
# are a beam's candidates (beam_search.BeamSearchParams.num_candidates): its width plus every
# stop token id, EOS ids included (no model has more than MAX_EOS_TOKEN_IDS of those).
MAX_EOS_TOKEN_IDS = 256
MAX_CORE_REQ_ID_BYTES = 4 * MAX_REQUEST_ID_CHARS + 64
MAX_TOP_LOGPROBS_PER_TOKEN = max(MAX_TOP_LOGPROBS, MAX_BEAM_WIDTH + MAX_STOP_TOKEN_IDS + MAX_EOS_TOKEN_IDS)


def max_executor_message_bytes(max_tokens_per_step: int) -> int:
    """The size of the largest ExecutorMessage an honest executor can send (for ZMQ_MAXMSGSIZE).

    A StepResult of a step of `max_tokens_per_step` tokens: at most that many sampled tokens
    (each with the longest request id and the most top logprobs), and as many failed requests
    (each with the longest message), every field at its widest encoding. Other messages are far
    smaller. Measured by protobuf itself, so the bound follows the schema.
    """
    req_id = "\U0010ffff" * (MAX_CORE_REQ_ID_BYTES // 4)
    widest = dict(token_id=2**32 - 1, logprob=-1.0)
    token = xpb.SampledToken(req_id=req_id, **widest, top_logprobs=[xpb.TopToken(**widest)] * MAX_TOP_LOGPROBS_PER_TOKEN)
    error = xpb.RequestError(req_id=req_id, message="\U0010ffff" * MAX_ERROR_MESSAGE_CHARS)
    one_row = xpb.StepResult(sampled=[token], errors=[error]).ByteSize()
    step = xpb.StepResult(step_id=2**64 - 1, error="\U0010ffff" * MAX_ERROR_MESSAGE_CHARS).ByteSize()
    return xpb.ExecutorMessage(step_result=xpb.StepResult()).ByteSize() + 16 + step + max_tokens_per_step * one_row
