"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with the
HTTP status OpenAI's clients expect (their typed exceptions are chosen by it).

`param` is always OpenAI's name of the field: a check of the scheduler names the gRPC field
(`sampling.logit_bias[7]: ...`), which is rewritten to the request's own (`logit_bias: ...`);
`constraint.<kind>` is the field the constraint came from (`response_format`,
`tools[0].function.parameters`, ...), which the route knows.
"""

from __future__ import annotations

import json
import re

import grpc
from fastapi.responses import JSONResponse

from pagoda.client import PagodaError

_BY_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    # The scheduler's LoRA refusals that no request could fix but the operator (--enable-lora off):
    # vLLM answers them 400 too.
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}

# gRPC field (the scheduler's check) -> the OpenAI request field it came from.
_OPENAI_FIELD = {
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.min_p": "min_p",
    "sampling.seed": "seed",
    "sampling.n": "n",
    "sampling.presence_penalty": "presence_penalty",
    "sampling.frequency_penalty": "frequency_penalty",
    "sampling.repetition_penalty": "repetition_penalty",
    "sampling.logit_bias": "logit_bias",
    "stopping.max_tokens": "max_tokens",
    "stopping.min_tokens": "min_tokens",
    "stopping.stop": "stop",
    "stopping.ignore_eos": "ignore_eos",
    "prompt.text": "prompt",
    "prompt.token_ids": "prompt",
    "prompt.chat": "messages",
    "prompt": "prompt",
    "model": "model",
    "lora_name": "lora_name",
    "lora_path": "lora_path",
}
_CHAT_FIELD = {"prompt": "messages", "response.top_logprobs": "top_logprobs"}
_COMPLETION_FIELD = {"response.top_logprobs": "logprobs"}
_GRPC_FIELD = re.compile(r"^([a-z_]+(?:\.[a-z_]+)*)((?:\[[^\]]*\]|\.[a-z_]+)*)$")


def openai_field(grpc_field: str, chat: bool) -> str | None:
    """`sampling.logit_bias[7]` -> `logit_bias`; `prompt.chat.messages[2].content` -> `messages`
    (chat); None for a field that has no OpenAI name."""
    match = _GRPC_FIELD.match(grpc_field)
    if not match:
        return None
    path = match.group(1)
    while path:
        name = (_CHAT_FIELD if chat else _COMPLETION_FIELD).get(path) or _OPENAI_FIELD.get(path)
        if name:
            return "messages" if chat and name == "prompt" else name
        path = path.rpartition(".")[0]
    return None


class GatewayError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    @classmethod
    def from_pagoda(cls, err: PagodaError, chat: bool = False, constraint: str | None = None,
                    model: str | None = None) -> GatewayError:
        """The scheduler's refusal in OpenAI's shape; `constraint`: the request field the constraint
        came from; `model`: the adapter the request named, whose NOT_FOUND is OpenAI's (and vLLM's)
        404 `model_not_found`."""
        if model and err.code == grpc.StatusCode.NOT_FOUND:  # a request's only NOT_FOUND: its adapter
            reason = err.details.removeprefix("model: ")
            message = f"The model `{model}` does not exist" + (f": {reason}" if reason else ".")
            return cls(404, message, param="model", code="model_not_found")
        status, kind = _BY_STATUS.get(err.code, (500, "internal_error"))
        message, param = err.details, None
        # The scheduler names the field first: "sampling.top_p: must be in (0, 1], got 1.5".
        field, sep, rest = err.details.partition(": ")
        if sep and " " not in field:
            param = constraint if constraint and field.startswith("constraint") else openai_field(field, chat)
            if param:
                message = f"{param}: {rest}"
        return cls(status, message, kind, param, err.code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def anthropic_response(self) -> JSONResponse:
        """The error in Anthropic's shape (`/v1/messages`), its type chosen by the status as Anthropic's."""
        kind = _ANTHROPIC_TYPE.get(self.status, "api_error")
        body = {"type": "error", "error": {"type": kind, "message": self.message}}
        return JSONResponse(body, status_code=self.status)


# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"request body larger than {limit} bytes (the gateway's --max-request-bytes)",
                        code="request_too_large")


def invalid_json(exc: ValueError) -> GatewayError:
    """A body that is not JSON: the parser's reason and where (OpenAI answers 400 here too)."""
    if isinstance(exc, json.JSONDecodeError):
        where = f" at line {exc.lineno} column {exc.colno} (byte {exc.pos})"
        return GatewayError(400, f"request body is not valid JSON: {exc.msg}{where}", code="invalid_json")
    return GatewayError(400, f"request body is not valid JSON: {exc}", code="invalid_json")


def _param(loc: tuple) -> str | None:
    """OpenAI's name for a pydantic error location: the top-level field, or `messages.<i>.<field>`.
    Pydantic's union-member tags (`function-after[...]`, `list[int]`, `[key]`) are left out."""
    parts = [str(p) for p in loc if p != "body" and not re.search(r"[\[\](),-]", str(p))]
    if not parts:
        return None
    if parts[0] in ("messages", "input") and len(parts) >= 3 and parts[1].isdigit():
        return ".".join(parts[:3])
    return parts[0]


def validation_error(errors: list[dict]) -> GatewayError:
    """A pydantic ValidationError's most telling problem, naming the field. Of a union's several
    errors (one per member type), one that is not a mere type mismatch is the one to show."""
    if not errors:
        return GatewayError(400, "invalid request")
    telling = [e for e in errors if not e["type"].endswith(("_type", "_parsing"))]
    first = (telling or errors)[0]
    loc = tuple(first.get("loc", ()))
    if first["type"] == "extra_forbidden":
        name = ".".join(str(p) for p in loc if p != "body")
        return GatewayError(400, f"Unrecognized request argument supplied: {name}", param=name)
    param = _param(loc)
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    return GatewayError(400, f"{param}: {msg}" if param else msg, param=param)
