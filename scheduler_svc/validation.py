"""Checks a GenerateRequest before any work is done and turns it into typed parameters.

Every problem raises InvalidArgument naming the field, e.g.
`sampling.top_p: must be in (0, 1], got 1.5`.

Beam search (`sampling.beam_width` 2..16, `n <= beam_width`) is deterministic: it
scores raw log-probabilities, so `temperature`, `top_p`, `top_k`, `min_p` and `seed`
are ignored; penalties, `logit_bias` and stop strings, which would change what it
computes, are refused.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from pagoda.step import SamplingParams
from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.core import fit_error
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.tokenizer import ModelSpec, apply_chat_template, encode_text

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_BEAM_WIDTH = 16
MAX_STOP_STRINGS = 16
MAX_CACHE_SALT_CHARS = 256


@dataclass(frozen=True)
class GenerateParams:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # seed is the request's; sample i uses seed + i
    n: int
    max_tokens: int | None  # None = up to max_model_len (and the executor's KV capacity)
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    priority: int
    eos_token_ids: frozenset[int]
    beam_width: int = 1  # > 1: beam search, the n best of beam_width beams
    cache_salt: str = ""  # prefix-cache hits only among equal salts (the server adds the tenant)


def validate_generate(
    req: pb.GenerateRequest, tokenizer: PreTrainedTokenizerBase, spec: ModelSpec, max_model_len: int
) -> GenerateParams:
    prompt_ids = _prompt_token_ids(req, tokenizer, spec.vocab_size)
    sampling_msg, stopping, response = req.sampling, req.stopping, req.response
    temperature = _float(sampling_msg, "temperature", 1.0)
    if not temperature >= 0:
        raise InvalidArgument("sampling.temperature", f"must be >= 0, got {temperature}")
    top_p = _float(sampling_msg, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {top_p}")
    top_k = sampling_msg.top_k if sampling_msg.HasField("top_k") else 0
    if top_k < 0:
        raise InvalidArgument("sampling.top_k", f"must be >= 0 (0 = off), got {top_k}")
    min_p = _float(sampling_msg, "min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise InvalidArgument("sampling.min_p", f"must be in [0, 1], got {min_p}")
    repetition_penalty = _float(sampling_msg, "repetition_penalty", 1.0)
    if not repetition_penalty > 0:
        raise InvalidArgument("sampling.repetition_penalty", f"must be > 0, got {repetition_penalty}")
    presence_penalty = _float(sampling_msg, "presence_penalty", 0.0)
    frequency_penalty = _float(sampling_msg, "frequency_penalty", 0.0)
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not -2 <= value <= 2:
            raise InvalidArgument(f"sampling.{name}", f"must be in [-2, 2], got {value}")
    n = sampling_msg.n if sampling_msg.HasField("n") else 1
    if not 1 <= n <= MAX_N:
        raise InvalidArgument("sampling.n", f"must be in [1, {MAX_N}], got {n}")
    beam_width = max(sampling_msg.beam_width if sampling_msg.HasField("beam_width") else 1, 1)
    if beam_width > MAX_BEAM_WIDTH:
        raise InvalidArgument("sampling.beam_width", f"must be in [1, {MAX_BEAM_WIDTH}], got {beam_width}")
    if beam_width > 1:
        _check_beam_search(req, n, beam_width)
    for token_id, bias in sampling_msg.logit_bias.items():
        if token_id >= spec.vocab_size:
            raise InvalidArgument("sampling.logit_bias", f"token id {token_id} is outside the vocabulary ({spec.vocab_size})")
        if not math.isfinite(bias):
            raise InvalidArgument("sampling.logit_bias", f"bias for token {token_id} must be finite")

    max_tokens = stopping.max_tokens if stopping.HasField("max_tokens") else None
    if max_tokens == 0:
        raise InvalidArgument("stopping.max_tokens", "must be >= 1")
    problem = fit_error(len(prompt_ids), max_tokens, max_model_len)
    if problem:
        raise InvalidArgument(problem[0], f"{problem[1]} (max_model_len)")
    min_tokens = stopping.min_tokens if stopping.HasField("min_tokens") else 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidArgument("stopping.min_tokens", f"{min_tokens} exceeds max_tokens {max_tokens}")
    if len(stopping.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument("stopping.stop", f"at most {MAX_STOP_STRINGS} stop strings")
    if any(s == "" for s in stopping.stop):
        raise InvalidArgument("stopping.stop", "stop strings must not be empty")
    for token_id in stopping.stop_token_ids:
        if token_id >= spec.vocab_size:
            raise InvalidArgument("stopping.stop_token_ids", f"token id {token_id} is outside the vocabulary ({spec.vocab_size})")
    if response.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument("response.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {response.top_logprobs}")
    priority = req.priority if req.HasField("priority") else 0
    if len(req.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument("cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters, got {len(req.cache_salt)}")

    eos = frozenset(() if stopping.ignore_eos else spec.eos_token_ids)
    stop_token_ids = tuple(sorted(eos | set(stopping.stop_token_ids)))
    sampling = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=sampling_msg.seed if sampling_msg.HasField("seed") else None,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        logit_bias=tuple(sorted(sampling_msg.logit_bias.items())),
        min_tokens=min_tokens,
        stop_token_ids=stop_token_ids,
        logprobs=response.logprobs or response.top_logprobs > 0,
        top_logprobs=response.top_logprobs,
    )
    return GenerateParams(
        request_id=req.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        n=n,
        max_tokens=max_tokens,
        stop=tuple(stopping.stop),
        include_stop_str_in_output=stopping.include_stop_str_in_output,
        skip_special_tokens=response.skip_special_tokens if response.HasField("skip_special_tokens") else True,
        priority=priority,
        eos_token_ids=eos,
        beam_width=beam_width,
        cache_salt=req.cache_salt,
    )


def _check_beam_search(req: pb.GenerateRequest, n: int, beam_width: int) -> None:
    if n > beam_width:
        raise InvalidArgument("sampling.n", f"must be <= beam_width ({beam_width}) with beam search, got {n}")
    sampling = req.sampling
    neutral = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    for name, value in neutral.items():
        if sampling.HasField(name) and getattr(sampling, name) != value:
            raise InvalidArgument(f"sampling.{name}", "is not supported with beam search (beam_width > 1)")
    if any(bias != 0 for bias in sampling.logit_bias.values()):
        raise InvalidArgument("sampling.logit_bias", "is not supported with beam search (beam_width > 1)")
    if req.stopping.stop:
        raise InvalidArgument("stopping.stop", "stop strings are not supported with beam search (beam_width > 1)")


def _float(msg, field: str, default: float) -> float:
    if not msg.HasField(field):
        return default
    value = getattr(msg, field)
    if math.isnan(value):
        raise InvalidArgument(f"sampling.{field}", "must be a number, got NaN")
    return value


def _prompt_token_ids(req: pb.GenerateRequest, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> list[int]:
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgument("prompt", "one of text, token_ids or chat is required")
    if kind == "text":
        if not req.text:
            raise InvalidArgument("prompt.text", "must not be empty")
        return encode_text(tokenizer, req.text)
    if kind == "token_ids":
        ids = list(req.token_ids.ids)
        if not ids:
            raise InvalidArgument("prompt.token_ids", "must not be empty")
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidArgument("prompt.token_ids", f"token id {bad} is outside the vocabulary ({vocab_size})")
        return ids
    return chat_token_ids(req.chat, tokenizer, "prompt.chat")


def chat_token_ids(chat: pb.Chat, tokenizer: PreTrainedTokenizerBase, field: str, add_generation_prompt: bool = True) -> list[int]:
    if not chat.messages:
        raise InvalidArgument(f"{field}.messages", "must not be empty")
    for i, message in enumerate(chat.messages):
        if not message.role:
            raise InvalidArgument(f"{field}.messages[{i}].role", "must not be empty")
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    try:
        return apply_chat_template(tokenizer, messages, add_generation_prompt)
    except Exception as exc:  # a template may reject a role order, say
        raise InvalidArgument(f"{field}.messages", f"the chat template rejected them: {exc}") from exc
