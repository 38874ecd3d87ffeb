"""Checks a GenerateRequest before any work is done and turns it into typed parameters.

Every problem raises InvalidArgument naming the field, e.g.
`sampling.top_p: must be in (0, 1], got 1.5`.

Two phases, so that the costly one runs off the event loop (`scheduler_svc.prompts`):
`check_fields` (every field that needs no tokenizer, cheap: limits on everything a client
sizes — request_id, stop strings, stop_token_ids, logit_bias —, NaN and +-Inf refused in
every float, and a first bound on the prompt's length from its characters), then
`prompt_token_ids` (tokenize / chat template), then `build_params` (the checks that need
the token count). `validate_generate` runs all three inline.

Beam search (`sampling.beam_width` 2..16, `n <= beam_width`) is deterministic: it
scores raw log-probabilities, so `temperature`, `top_p`, `top_k`, `min_p` and `seed`
are ignored; penalties, `logit_bias` and stop strings, which would change what it
computes, are refused.

A structured-output `constraint` gets its cheap checks here (size, JSON where the kind is
JSON, no beam search, no `ignore_eos`); whether it compiles is checked off the event loop
by `scheduler_svc.constraint_check` before the request is submitted.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from pagoda.constraint import Constraint, ConstraintKind
from pagoda.step import SamplingParams
from pagoda.wire import constraint_from_proto
from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.core import fit_error
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.chat import message_chars, template_input, template_kwargs
from scheduler_svc.tokenizer import ModelSpec, TooManyTokens, apply_chat_template, encode_text, render_chat

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_BEAM_WIDTH = 16
MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_CACHE_SALT_CHARS = 256
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's bound: +-100 already bans or forces a token
MAX_CONSTRAINT_CHARS = 256 * 1024  # a schema, regex or grammar; the choices together
MAX_CHOICES = 1024

# Every float of SamplingParams: NaN and +-Inf are refused for all of them.
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


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
    lora: str = ""  # the LoRA adapter (GenerateRequest.model, resolved by the server), "" for the base model
    # the reasoning split (pagoda.reasoning): (parser, the state its outputs start in), or None
    reasoning: tuple | None = None
    images: tuple = ()  # a chat's images (pagoda.step.ImageInput), in prompt order


def validate_generate(
    req: pb.GenerateRequest, tokenizer: PreTrainedTokenizerBase, spec: ModelSpec, max_model_len: int
) -> GenerateParams:
    """Every check, with the prompt tokenized inline (the server tokenizes off its event loop)."""
    checked = check_fields(req, spec, max_model_len)
    ids = prompt_token_ids(req, tokenizer, spec.vocab_size, max_model_len)
    return build_params(req, checked, ids, spec, max_model_len)


def check_fields(req: pb.GenerateRequest, spec: ModelSpec, max_model_len: int) -> SamplingParams:
    """Every check that needs no tokenizer, cheap enough for the event loop; the sampling parameters.

    This includes a first bound on the prompt's length: a text (or chat) so long that even at
    `spec.max_token_chars` characters a token it cannot fit `max_model_len` is refused here,
    before the costly tokenization.
    """
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(req.request_id)}")
    _check_prompt_bound(req, spec, max_model_len)
    sampling_msg, stopping, response = req.sampling, req.stopping, req.response
    floats = {name: getattr(sampling_msg, name) for name in _FLOAT_FIELDS if sampling_msg.HasField(name)}
    for name, value in floats.items():
        if not math.isfinite(value):
            raise InvalidArgument(f"sampling.{name}", f"must be a finite number, got {value}")
    temperature = floats.get("temperature", 1.0)
    if not temperature >= 0:
        raise InvalidArgument("sampling.temperature", f"must be >= 0, got {temperature}")
    top_p = floats.get("top_p", 1.0)
    if not 0 < top_p <= 1:
        raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {top_p}")
    top_k = sampling_msg.top_k if sampling_msg.HasField("top_k") else 0
    if top_k < 0:
        raise InvalidArgument("sampling.top_k", f"must be >= 0 (0 = off), got {top_k}")
    min_p = floats.get("min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise InvalidArgument("sampling.min_p", f"must be in [0, 1], got {min_p}")
    repetition_penalty = floats.get("repetition_penalty", 1.0)
    if not repetition_penalty > 0:
        raise InvalidArgument("sampling.repetition_penalty", f"must be > 0, got {repetition_penalty}")
    presence_penalty = floats.get("presence_penalty", 0.0)
    frequency_penalty = floats.get("frequency_penalty", 0.0)
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not -2 <= value <= 2:
            raise InvalidArgument(f"sampling.{name}", f"must be in [-2, 2], got {value}")
    n = sampling_msg.n if sampling_msg.HasField("n") else 1
    if not 1 <= n <= MAX_N:
        raise InvalidArgument("sampling.n", f"must be in [1, {MAX_N}], got {n}")
    beam_width = _beam_width(req)
    if beam_width > MAX_BEAM_WIDTH:
        raise InvalidArgument("sampling.beam_width", f"must be in [1, {MAX_BEAM_WIDTH}], got {beam_width}")
    if beam_width > 1:
        _check_beam_search(req, n, beam_width)
    if len(sampling_msg.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument(
            "sampling.logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(sampling_msg.logit_bias)}"
        )
    for token_id, bias in sampling_msg.logit_bias.items():
        if token_id >= spec.vocab_size:
            raise InvalidArgument("sampling.logit_bias", f"token id {token_id} is outside the vocabulary ({spec.vocab_size})")
        if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:  # NaN fails too
            raise InvalidArgument(
                "sampling.logit_bias",
                f"bias for token {token_id} must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], got {bias}",
            )

    max_tokens = stopping.max_tokens if stopping.HasField("max_tokens") else None
    if max_tokens == 0:
        raise InvalidArgument("stopping.max_tokens", "must be >= 1")
    if max_tokens is not None and max_tokens >= max_model_len:
        raise InvalidArgument("stopping.max_tokens", f"{max_tokens} leaves no room for a prompt within max_model_len {max_model_len}")
    min_tokens = stopping.min_tokens if stopping.HasField("min_tokens") else 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidArgument("stopping.min_tokens", f"{min_tokens} exceeds max_tokens {max_tokens}")
    if min_tokens >= max_model_len:
        raise InvalidArgument("stopping.min_tokens", f"{min_tokens} cannot fit within max_model_len {max_model_len}")
    if len(stopping.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument("stopping.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stopping.stop)}")
    for i, stop in enumerate(stopping.stop):
        if not stop:
            raise InvalidArgument(f"stopping.stop[{i}]", "stop strings must not be empty")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidArgument(f"stopping.stop[{i}]", f"at most {MAX_STOP_STRING_CHARS} characters, got {len(stop)}")
    if len(stopping.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(
            "stopping.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(stopping.stop_token_ids)}"
        )
    for token_id in stopping.stop_token_ids:
        if token_id >= spec.vocab_size:
            raise InvalidArgument("stopping.stop_token_ids", f"token id {token_id} is outside the vocabulary ({spec.vocab_size})")
    if response.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument("response.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {response.top_logprobs}")
    if len(req.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument("cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters, got {len(req.cache_salt)}")
    constraint = check_constraint(req) if req.HasField("constraint") else None

    return SamplingParams(
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
        stop_token_ids=tuple(sorted(_eos(stopping, spec) | set(stopping.stop_token_ids))),
        logprobs=response.logprobs or response.top_logprobs > 0,
        top_logprobs=response.top_logprobs,
        constraint=constraint,
    )


def check_constraint(req: pb.GenerateRequest) -> Constraint | None:
    """The request's constraint after the checks that need no compiler (None: unset)."""
    constraint = constraint_from_proto(req.constraint)
    if constraint is None:
        return None
    name = constraint.field
    if constraint.size > MAX_CONSTRAINT_CHARS:
        raise InvalidArgument(name, f"at most {MAX_CONSTRAINT_CHARS} characters, got {constraint.size}")
    kind = constraint.kind
    if kind is ConstraintKind.CHOICE:
        if not constraint.choices:
            raise InvalidArgument("constraint.choice.choices", "must not be empty")
        if len(constraint.choices) > MAX_CHOICES:
            raise InvalidArgument("constraint.choice.choices", f"at most {MAX_CHOICES}, got {len(constraint.choices)}")
    elif kind is not ConstraintKind.JSON_OBJECT and not constraint.value.strip():
        raise InvalidArgument(name, "must not be empty")
    if kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.STRUCTURAL_TAG):
        try:
            json.loads(constraint.value)
        except ValueError as exc:
            raise InvalidArgument(name, f"is not valid JSON: {exc}") from None
    if _beam_width(req) > 1:
        raise InvalidArgument("constraint", "is not supported with beam search (beam_width > 1)")
    if req.stopping.ignore_eos:
        raise InvalidArgument(
            "stopping.ignore_eos", "cannot be combined with a constraint: a constrained output ends with EOS when its grammar is complete"
        )
    return constraint


def build_params(
    req: pb.GenerateRequest, sampling: SamplingParams, prompt_ids: list[int], spec: ModelSpec, max_model_len: int
) -> GenerateParams:
    """The checks that need the prompt's tokens, then the request's typed parameters."""
    stopping, response = req.stopping, req.response
    if not prompt_ids:  # found by bench/fuzz.py: text of characters the tokenizer drops, e.g. "\x16"
        raise InvalidArgument(f"prompt.{req.WhichOneof('prompt')}", "has no tokens once tokenized")
    max_tokens = stopping.max_tokens if stopping.HasField("max_tokens") else None
    problem = fit_error(len(prompt_ids), max_tokens, max_model_len)
    if problem:
        raise InvalidArgument(problem[0], f"{problem[1]} (max_model_len)")
    return GenerateParams(
        request_id=req.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        n=req.sampling.n if req.sampling.HasField("n") else 1,
        max_tokens=max_tokens,
        stop=tuple(stopping.stop),
        include_stop_str_in_output=stopping.include_stop_str_in_output,
        skip_special_tokens=response.skip_special_tokens if response.HasField("skip_special_tokens") else True,
        priority=req.priority if req.HasField("priority") else 0,
        eos_token_ids=_eos(stopping, spec),
        beam_width=_beam_width(req),
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


def _beam_width(req: pb.GenerateRequest) -> int:
    return max(req.sampling.beam_width if req.sampling.HasField("beam_width") else 1, 1)


def _eos(stopping: pb.StoppingCriteria, spec: ModelSpec) -> frozenset[int]:
    return frozenset(() if stopping.ignore_eos else spec.eos_token_ids)


def _check_prompt_bound(req: pb.GenerateRequest, spec: ModelSpec, max_model_len: int) -> None:
    """Refuse, before tokenizing, a prompt that cannot have fewer than max_model_len tokens.

    A token never covers more than `spec.max_token_chars` characters of its text, so a text of
    c characters has at least c / max_token_chars tokens; a chat's contents likewise.
    """
    kind = req.WhichOneof("prompt")
    if kind == "token_ids":
        num = len(req.token_ids.ids)
        if num >= max_model_len:
            raise InvalidArgument("prompt.token_ids", f"{num} tokens leave no room to generate within max_model_len {max_model_len}")
        return
    if kind == "text":
        chars, field = counted_chars(req.text, spec), "prompt.text"
    elif kind == "chat":
        chars, field = sum(counted_chars(message_chars(m), spec) for m in req.chat.messages), "prompt.chat"
    else:
        return
    limit = max_prompt_chars(spec, max_model_len)
    if chars > limit:
        raise InvalidArgument(
            field, f"{chars} characters are more than max_model_len {max_model_len} tokens can hold (at most {limit})"
        )


def counted_chars(text: str, spec: ModelSpec) -> int:
    """Characters of `text` that become tokens: those the tokenizer drops do not count."""
    return len(text) - sum(text.count(c) for c in spec.ignored_chars)


def max_prompt_chars(spec: ModelSpec, max_model_len: int) -> int:
    """The longest text that could still tokenize to fewer than `max_model_len` tokens."""
    return max_model_len * spec.max_token_chars


def prompt_token_ids(
    req: pb.GenerateRequest, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_model_len: int | None = None
) -> list[int]:
    """The prompt's token ids: tokenizes or applies the chat template (slow for long prompts).

    With `max_model_len`, a text or chat of `max_model_len` tokens or more (no room to generate) is
    refused having tokenized about that many of it (`tokenizer.encode_at_most`), not all of it.
    """
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgument("prompt", "one of text, token_ids or chat is required")
    max_tokens = None if max_model_len is None else max_model_len - 1
    if kind == "text":
        if not req.text:
            raise InvalidArgument("prompt.text", "must not be empty")
        try:
            return encode_text(tokenizer, req.text, max_tokens)
        except TooManyTokens as exc:
            raise InvalidArgument("prompt.text", _no_room(exc, max_model_len)) from None
    if kind == "token_ids":
        ids = list(req.token_ids.ids)
        if not ids:
            raise InvalidArgument("prompt.token_ids", "must not be empty")
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidArgument("prompt.token_ids", f"token id {bad} is outside the vocabulary ({vocab_size})")
        return ids
    try:
        return chat_token_ids(req.chat, tokenizer, "prompt.chat", max_tokens=max_tokens)
    except TooManyTokens as exc:
        raise InvalidArgument("prompt.chat", _no_room(exc, max_model_len)) from None


def _no_room(exc: TooManyTokens, max_model_len: int) -> str:
    return f"{exc} leave no room to generate within {max_model_len} tokens (max_model_len)"


def chat_text(chat: pb.Chat, tokenizer: PreTrainedTokenizerBase, field: str, add_generation_prompt: bool = True) -> str:
    """The chat template's text (a chat with images: the processor tokenizes it, `media.ImagePrompts`)."""
    messages, tools = template_input(chat, field)
    kwargs = template_kwargs(chat, field)
    try:
        return render_chat(tokenizer, messages, add_generation_prompt, tools, kwargs)
    except Exception as exc:  # a template may reject a role order, say
        raise InvalidArgument(f"{field}.messages", f"the chat template rejected them: {exc}") from exc


def chat_token_ids(
    chat: pb.Chat, tokenizer: PreTrainedTokenizerBase, field: str, add_generation_prompt: bool = True,
    max_tokens: int | None = None,
) -> list[int]:
    """The chat template's token ids; more than `max_tokens` raise TooManyTokens."""
    messages, tools = template_input(chat, field)
    kwargs = template_kwargs(chat, field)
    try:
        return apply_chat_template(tokenizer, messages, add_generation_prompt, tools, max_tokens, kwargs)
    except TooManyTokens:
        raise
    except Exception as exc:  # a template may reject a role order, say
        raise InvalidArgument(f"{field}.messages", f"the chat template rejected them: {exc}") from exc
