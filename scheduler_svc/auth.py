"""Who may call pagoda.v1.Generation: API keys (with tenants) and TLS for the gRPC server.

API keys. `--api-key KEY` (repeatable) and `--api-key-file PATH` (lines `key`, `key tenant` or
`key tenant admin`; `#` comments) make every pagoda.v1.Generation and vllm.grpc.engine.VllmEngine RPC require metadata
`authorization: Bearer <key>`; without one, or with an unknown one, the RPC ends with
UNAUTHENTICATED before the servicer runs. grpc.health.v1 and server reflection stay open,
so load balancers and probes need no key. A key is compared with every configured key
in constant time (`hmac.compare_digest`, no early exit), so timing tells nothing about how
much of a guess was right.

Tenants. A key's tenant scopes the prefix cache (requests of different tenants never hit
each other's cached blocks, see `prefix_cache_salt`), the request ids (the engine keys a
request by (tenant, request_id): no tenant sees, collides with or aborts another's) and a
share of the queue (--max-requests-per-tenant). A key without a tenant is a tenant of its
own. The engine reads the caller's tenant with `current_tenant()` (a context variable the
interceptor sets around the handler), so every servicer on the server gets the same rules.
Refusals are logged at most once per REFUSAL_LOG_INTERVAL_S, counted: a keyless flood is
no flood of log lines.

Admin keys. A key file's line `key tenant admin` marks an operator's key: only such a key may
call what acts on every tenant at once (`VllmEngine.FlushCache` empties every tenant's prefix
cache); another key gets PERMISSION_DENIED (`caller_is_admin()`). `--api-key` keys are never
admin. Without keys there are no tenants, and every caller is the operator.

TLS. `--ssl-certfile` + `--ssl-keyfile` serve TLS; `--ssl-ca-certs` adds mutual TLS: clients
must present a certificate signed by that CA.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

# The services whose every RPC needs a key (the engine protocol serves the same requests).
PROTECTED_PREFIXES = ("/pagoda.v1.Generation/", "/vllm.grpc.engine.VllmEngine/")
# Refusals are logged at most once per interval, with their count: a flood of keyless calls
# must not become a flood of log lines.
REFUSAL_LOG_INTERVAL_S = 10.0
_TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("pagoda_tenant", default="")
# True where no interceptor runs (keys off); with keys, set for every RPC from its key.
_ADMIN: contextvars.ContextVar[bool] = contextvars.ContextVar("pagoda_admin", default=True)
ADMIN_MARK = "admin"


def current_tenant() -> str:
    """The tenant of the API key of the RPC being served ("" when keys are off)."""
    return _TENANT.get()


def caller_is_admin() -> bool:
    """Whether the RPC being served came with an admin key (every caller when keys are off)."""
    return _ADMIN.get()


def prefix_cache_salt(tenant: str, cache_salt: str) -> str:
    """One string for both: the tenant's length prefix keeps ("ab", "c") and ("a", "bc") apart."""
    if not tenant and not cache_salt:
        return ""
    return f"{len(tenant)}:{tenant}|{cache_salt}"


@dataclass(frozen=True)
class ApiKey:
    key: bytes
    tenant: str
    admin: bool = False


def load_api_keys(keys: list[str] | None, key_file: str | None) -> list[ApiKey]:
    """The keys of `--api-key` and `--api-key-file`; ValueError on an empty or malformed entry."""
    entries: list[tuple[str, str | None, bool, str]] = [(key, None, False, "--api-key") for key in keys or ()]
    if key_file:
        for number, line in enumerate(Path(key_file).read_text().splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            where = f"{key_file}:{number}"
            if len(fields) > 3 or (len(fields) == 3 and fields[2] != ADMIN_MARK):
                raise ValueError(f"{where}: expected `key`, `key tenant` or `key tenant {ADMIN_MARK}`, "
                                 f"got {len(fields)} fields")
            entries.append((fields[0], fields[1] if len(fields) >= 2 else None, len(fields) == 3, where))
    out = []
    for key, tenant, admin, where in entries:
        key = key.strip()
        if len(key) < 16:
            raise ValueError(f"{where}: an API key must have at least 16 characters")
        if tenant is None:  # a tenant of its own, named without revealing the key
            tenant = "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]
        out.append(ApiKey(key.encode(), tenant, admin))
    return out


def _bearer(metadata) -> bytes | None:
    for name, value in metadata or ():
        if name == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token:
                return token.strip().encode()
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for RPCs of PROTECTED_PREFIXES without a known key; the rest pass."""

    def __init__(self, keys: list[ApiKey]):
        if not keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self._keys = keys
        self._num_refused = 0
        self._last_refusal_log = -math.inf

    def key_of(self, token: bytes | None) -> ApiKey | None:
        """The entry of `token`, None if it is no key. Looks at every key whatever matches."""
        found = None
        for entry in self._keys:
            if hmac.compare_digest(entry.key, token or b"") and found is None:
                found = entry
        return found if token else None

    def tenant_of(self, token: bytes | None) -> str | None:
        """The tenant of `token`, None if it is no key."""
        entry = self.key_of(token)
        return entry.tenant if entry else None

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(PROTECTED_PREFIXES):
            return handler
        entry = self.key_of(_bearer(handler_call_details.invocation_metadata))
        if entry is None:
            self._log_refusal(handler_call_details.method)
            return _refusing(handler)
        return _with_tenant(handler, entry.tenant, entry.admin)

    def _log_refusal(self, method: str) -> None:
        self._num_refused += 1
        now = time.monotonic()
        if now - self._last_refusal_log >= REFUSAL_LOG_INTERVAL_S:
            log.warning("refused %d RPCs without a valid API key (the latest: %s)", self._num_refused, method)
            self._num_refused, self._last_refusal_log = 0, now


_MESSAGE = "a valid API key is required: metadata `authorization: Bearer <key>`"


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    codecs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_stream:
        async def refuse_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)
            yield  # pragma: no cover (an async generator, as the handler kind requires)

        return grpc.unary_stream_rpc_method_handler(refuse_stream, **codecs)
    if handler.unary_unary:
        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)

        return grpc.unary_unary_rpc_method_handler(refuse, **codecs)
    raise TypeError("the protected services have only unary-unary and unary-stream RPCs")


def _with_tenant(handler: grpc.RpcMethodHandler, tenant: str, admin: bool) -> grpc.RpcMethodHandler:
    """`handler` with `current_tenant()` and `caller_is_admin()` set while it runs (in its own task,
    so in the handler itself)."""
    codecs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_stream:
        inner_stream = handler.unary_stream

        async def stream(request, context):
            _TENANT.set(tenant)
            _ADMIN.set(admin)
            async for response in inner_stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(stream, **codecs)
    if handler.unary_unary:
        inner = handler.unary_unary

        async def unary(request, context):
            _TENANT.set(tenant)
            _ADMIN.set(admin)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, **codecs)
    raise TypeError("the protected services have only unary-unary and unary-stream RPCs")


def server_credentials(certfile: str | None, keyfile: str | None, ca_certs: str | None) -> grpc.ServerCredentials | None:
    """TLS credentials for the gRPC port (mutual when `ca_certs`); None for plaintext. ValueError on a bad combination."""
    if not certfile and not keyfile:
        if ca_certs:
            raise ValueError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile")
        return None
    if not certfile or not keyfile:
        raise ValueError("--ssl-certfile and --ssl-keyfile go together")
    pair = (Path(keyfile).read_bytes(), Path(certfile).read_bytes())
    root = Path(ca_certs).read_bytes() if ca_certs else None
    return grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=root is not None)

