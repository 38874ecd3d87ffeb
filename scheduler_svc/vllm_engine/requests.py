"""A `vllm.grpc.engine.GenerateRequest` as Pagoda's own `pagoda.v1.GenerateRequest`.

The protocol is proto3 without presence on most fields, and its comments (and vLLM's servicer,
`smg_grpc_servicer.vllm.servicer._sampling_params_from_proto`) say what a zero means; Pagoda
follows them, not its own defaults:

    field (sampling_params.)     zero / absent means            Pagoda's field
    temperature (optional)       absent: 1.0                    sampling.temperature
    top_p                        0: 1.0 (off)                   sampling.top_p
    top_k, min_p                 0: off                         sampling.top_k, sampling.min_p
    repetition_penalty           0: 1.0 (off)                   sampling.repetition_penalty
    n                            0: 1                           sampling.n
    max_tokens (optional)        absent: up to max_model_len    stopping.max_tokens
    logprobs (optional)          absent: none; k: sampled + k   response.logprobs, top_logprobs
    seed (optional int32)        absent: none; negative: mod 2**64 (still reproducible)
    skip_special_tokens          false: special tokens kept in the text stop strings match
    truncate_prompt_tokens       k: the last k prompt tokens; -1: the last max_model_len - 1

Stop strings are matched on the detokenized text, as in vLLM, and end the request with
"stop" and `matched_stop_str`; the token that completed the match is in the output ids (the
router trims the text). The router detokenizes: the response carries token ids only.

Images (`media_refs`, `mm_inputs`) are read by `media.py`. What Pagoda cannot do is refused
before any work, naming the field: prefill/decode KV transfer, `prompt_logprobs`, `logprobs = -1` (all tokens), a data-parallel
rank other than 0 (the scheduler is one rank; it balances its executors itself). The
`constraint` oneof is Pagoda's structured output (`constraint_for`), and where it starts follows
the engine's reasoning parser as vLLM's does (`grammar_start`). Accepted
and without effect: `tokenized.original_text` (for reference, the protocol says) and
`spaces_between_special_tokens` (an option of slow tokenizers' decoding; Pagoda's are fast
and the response carries ids).
"""

from __future__ import annotations

import math

import grpc
from smg_grpc_proto import vllm_engine_pb2 as vpb

from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.errors import InvalidArgument, ServiceError

_U64 = 2**64


class Unimplemented(ServiceError):
    """A request field the protocol defines and Pagoda does not serve."""

    code = grpc.StatusCode.UNIMPLEMENTED

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


def to_pagoda_request(req: vpb.GenerateRequest, max_model_len: int, reasoning_parser: str = "") -> pb.GenerateRequest:
    """The Pagoda request for `req`; InvalidArgument / Unimplemented naming a vLLM field if refused.
    `reasoning_parser`: the scheduler's (--reasoning-parser; "" none), where a constraint starts.

    Pagoda's own validation then checks ranges and limits (`vllm_field_error` renames its fields).
    """
    _refuse_unserved(req)
    params = req.sampling_params
    out = pb.GenerateRequest(request_id=req.request_id)
    kind = req.WhichOneof("input")
    if kind == "tokenized":
        ids = list(req.tokenized.input_ids)
        out.token_ids.ids.extend(_truncated(ids, params, max_model_len))
    elif kind == "text":
        if params.HasField("truncate_prompt_tokens"):
            raise Unimplemented("sampling_params.truncate_prompt_tokens", "needs tokenized input (send `tokenized`)")
        out.text = req.text
    else:
        raise InvalidArgument("input", "one of tokenized or text is required")
    constraint = constraint_for(params)
    if constraint is not None:
        out.constraint.CopyFrom(constraint)
        if grammar_start(reasoning_parser, params) == AFTER_REASONING:
            out.reasoning_parser = reasoning_parser  # Pagoda's admission then starts it once the reasoning ends

    sampling = out.sampling
    if params.HasField("temperature"):
        sampling.temperature = params.temperature
    for name, off in (("top_p", 0.0), ("min_p", 0.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        if getattr(params, name) != off:
            setattr(sampling, name, getattr(params, name))
    if params.repetition_penalty != 0.0:
        sampling.repetition_penalty = params.repetition_penalty
    if params.top_k:
        sampling.top_k = min(params.top_k, 2**31 - 1)  # uint32 here, int32 there: both mean "all" past the vocabulary
    if params.n:
        sampling.n = params.n
    if params.HasField("seed"):
        sampling.seed = params.seed % _U64
    for token_id, bias in params.logit_bias.items():
        if token_id < 0:
            raise InvalidArgument("sampling_params.logit_bias", f"token id {token_id} is negative")
        sampling.logit_bias[token_id] = bias

    stopping = out.stopping
    if params.HasField("max_tokens"):
        stopping.max_tokens = params.max_tokens
    if params.min_tokens:
        stopping.min_tokens = params.min_tokens
    stopping.stop.extend(params.stop)
    stopping.stop_token_ids.extend(params.stop_token_ids)
    stopping.ignore_eos = params.ignore_eos
    stopping.include_stop_str_in_output = params.include_stop_str_in_output

    out.response.skip_special_tokens = params.skip_special_tokens
    if params.HasField("logprobs"):
        if params.logprobs < 0:
            raise InvalidArgument(
                "sampling_params.logprobs", f"must be in [0, 20]: {params.logprobs} (all tokens) is not served"
            )
        out.response.logprobs = True
        out.response.top_logprobs = params.logprobs  # Pagoda's check bounds it (20)
    return out


# GetServerInfo's `constrained_decoding_start`: where a request's grammar starts
AFTER_REASONING = "after_reasoning"
FIRST_TOKEN = "first_token"


def constrained_decoding_start(reasoning_parser: str) -> str:
    """Where this engine starts a constraint (GetServerInfo's `constrained_decoding_start`): after the
    reasoning when it runs a reasoning parser (vLLM's structured-output manager waits alike), else
    at the first generated token."""
    return AFTER_REASONING if reasoning_parser else FIRST_TOKEN


def grammar_start(reasoning_parser: str, params: vpb.SamplingParams) -> str:
    """Where this request's constraint starts: the engine's rule, unless the router shaped the
    grammar to run from the first token (`grammar_from_first_token`: it leads with the thought).

    After the reasoning is Pagoda's rule of `pagoda.v1` (`constrain_after_reasoning`): a prompt that
    closed the thought (`enable_thinking: false`) constrains from the first token, one that opened
    it lets the thought run to its end tag, and one with neither lets the output open one first.
    The split itself stays the router's: the response carries token ids only.
    """
    if params.grammar_from_first_token:
        return FIRST_TOKEN
    return constrained_decoding_start(reasoning_parser)


def constraint_for(params: vpb.SamplingParams) -> pb.Constraint | None:
    """The `constraint` oneof as `pagoda.v1.Constraint` (None when absent).

    vLLM's `StructuredOutputsParams` kinds map one to one onto `pagoda.v1.Constraint`'s:
    json_schema, regex, grammar, structural_tag, json_object, choice (`choices`). The compile
    check runs in the admission path shared with pagoda.v1 (its errors name `constraint.<kind>`,
    renamed `sampling_params.<kind>` here). Where it starts: `grammar_start`.
    """
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        return pb.Constraint(choice=pb.Choice(choices=params.choice.choices))
    return pb.Constraint(**{kind: getattr(params, kind)})


def _refuse_unserved(req: vpb.GenerateRequest) -> None:
    if req.HasField("kv_transfer_params"):
        raise Unimplemented("kv_transfer_params", "no prefill/decode disaggregation (no KV connector)")
    if req.HasField("kv_transfer_params_json"):
        raise Unimplemented("kv_transfer_params_json", "no prefill/decode disaggregation (no KV connector)")
    if req.HasField("data_parallel_rank") and req.data_parallel_rank != 0:
        raise InvalidArgument(
            "data_parallel_rank", f"this engine has one rank (0), got {req.data_parallel_rank}"
        )
    if req.sampling_params.HasField("prompt_logprobs"):
        raise Unimplemented("sampling_params.prompt_logprobs", "prompt logprobs are not computed by this engine")
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(req.sampling_params, name)
        if not math.isfinite(value):
            raise InvalidArgument(f"sampling_params.{name}", f"must be a finite number, got {value}")


def _truncated(ids: list[int], params: vpb.SamplingParams, max_model_len: int) -> list[int]:
    """vLLM's left truncation: the last k tokens (k = -1: as many as the model can take)."""
    if not params.HasField("truncate_prompt_tokens"):
        return ids
    k = params.truncate_prompt_tokens
    if k == -1:
        k = max_model_len - 1
    if k < 1:
        raise InvalidArgument("sampling_params.truncate_prompt_tokens", f"must be >= 1 or -1, got {k}")
    return ids[-k:]


# Pagoda's field names -> the protocol's: exact names, then prefixes ("sampling.top_p").
_FIELD_NAMES = {
    "response.top_logprobs": "sampling_params.logprobs",
    "prompt.token_ids": "tokenized.input_ids",
    "prompt.text": "text",
}
_FIELD_PREFIXES = (
    ("sampling.", "sampling_params."), ("stopping.", "sampling_params."), ("constraint.", "sampling_params."),
)


def vllm_field_error(error: ServiceError, req: vpb.GenerateRequest) -> ServiceError:
    """`error` naming the protocol's field where Pagoda's validation named its own."""
    field = getattr(error, "field", None)
    if not isinstance(error, InvalidArgument) or field is None:
        return error
    renamed = _FIELD_NAMES.get(field)
    if field == "prompt":  # the prompt as a whole (too long for max_model_len)
        renamed = "tokenized.input_ids" if req.WhichOneof("input") == "tokenized" else "text"
    for pagoda_prefix, vllm_prefix in _FIELD_PREFIXES:
        if renamed is None and field.startswith(pagoda_prefix):
            renamed = vllm_prefix + field[len(pagoda_prefix):]
    if renamed is None:
        return error
    return InvalidArgument(renamed, error.message[len(field) + 2:])
