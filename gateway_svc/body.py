"""A route's request body as its pydantic model: every problem with it is a 400 in OpenAI's shape
naming the position or the field (`errors`), before any gRPC call."""

from __future__ import annotations

import json

from fastapi import Request
from pydantic import BaseModel, ValidationError

from gateway_svc.admission import bearer_key
from gateway_svc.errors import GatewayError, invalid_json, validation_error


def bearer(request: Request) -> str | None:
    return bearer_key(request.scope)  # checked by Admission: printable ASCII


async def parse_body(request: Request, model: type[BaseModel]):
    """The request body as `model`; a body that is not JSON, or not a valid `model`, is a 400
    naming the position or the field, and a field not supported yet is a 400 naming it."""
    try:
        data = json.loads(await request.body())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise invalid_json(exc) from None
    except RecursionError:
        raise GatewayError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    if field := body.unsupported():
        raise GatewayError(400, f"{field}: not supported by this server yet", param=field, code="unsupported_parameter")
    return body
