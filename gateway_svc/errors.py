"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with the
HTTP status OpenAI's clients expect (their typed exceptions are chosen by it)."""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

from pagoda.client import PagodaError

_BY_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class GatewayError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    @classmethod
    def from_pagoda(cls, err: PagodaError) -> GatewayError:
        status, kind = _BY_STATUS.get(err.code, (500, "internal_error"))
        # The scheduler names the field first: "sampling.top_p: must be in (0, 1], got 1.5".
        field, sep, _ = err.details.partition(":")
        param = field if sep and " " not in field else None
        return cls(status, err.details, kind, param, err.code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def validation_error(errors: list[dict]) -> GatewayError:
    """A FastAPI RequestValidationError's first problem, naming the field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return GatewayError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param=param)
