"""Typed exceptions for gRPC statuses, so callers catch `RateLimited` rather than compare codes.

Every exception carries the status `code` and the server's `details` (which name the field
for a bad request, e.g. `sampling.top_p: must be in (0, 1], got 1.5`).
"""

from __future__ import annotations

import grpc


class PagodaError(Exception):
    """A failed call. `code` is the gRPC status, `details` the server's message."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None):
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


class InvalidArgument(PagodaError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(PagodaError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(PagodaError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(PagodaError):
    """E.g. a `model` (LoRA adapter) the scheduler has not loaded, or a `lora_path` that is not there."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(PagodaError):
    """E.g. LoRA adapters asked of a scheduler started without --enable-lora."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyExists(PagodaError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(PagodaError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(PagodaError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(PagodaError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(PagodaError):
    code = grpc.StatusCode.CANCELLED


class ResumeMismatch(PagodaError):
    """A resumed stream replayed tokens that differ from those already delivered: the
    request was not deterministic after all, so the client stops rather than splice."""

    code = grpc.StatusCode.DATA_LOSS


_BY_CODE = {cls.code: cls for cls in PagodaError.__subclasses__() if cls is not ResumeMismatch}


def from_rpc_error(err: grpc.RpcError) -> PagodaError:
    """The typed exception for a grpc (sync or aio) error."""
    code = err.code()
    return _BY_CODE.get(code, PagodaError)(err.details() or "", code)
