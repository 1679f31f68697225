"""The public side's door: API keys (a bearer token in gRPC metadata, vLLM's --api-key) and TLS.

With keys set, every Generation RPC needs `authorization: Bearer <key>` with one of them, else it
ends UNAUTHENTICATED before any handler runs. Health and reflection stay open: load balancers
and grpcurl probe them without credentials, and they reveal nothing about requests.

Each key is a tenant: the public request ids it uses are namespaced by it at the scheduler, so
Abort (and ALREADY_EXISTS) only ever sees the same key's requests.
"""
from __future__ import annotations

import hashlib
import hmac
import os

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
ENV_API_KEY = "PAGODA_API_KEY"


def api_keys_from(args) -> tuple[str, ...]:
    """--api-key (repeatable) plus PAGODA_API_KEY; empty = no authentication."""
    keys = list(getattr(args, "api_key", None) or [])
    if os.environ.get(ENV_API_KEY):
        keys.append(os.environ[ENV_API_KEY])
    return tuple(k for k in keys if k)


def _bearer(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


def key_of(metadata, keys: tuple[str, ...]) -> str | None:
    """The configured key the call presents, or None. Constant time in the key's content."""
    given = _bearer(metadata)
    if given is None:
        return None
    found = None
    for key in keys:
        if hmac.compare_digest(given.encode(), key.encode()):
            found = key
    return found


def tenant_of(metadata, keys: tuple[str, ...]) -> str:
    """The prefix that namespaces this call's public request ids ("" without keys)."""
    key = key_of(metadata, keys) if keys else None
    return tenant_of_key(key) if key else ""


def tenant_of_key(key: str) -> str:
    # A digest, not the key: the tenant travels to the scheduler and into its logs.
    return f"k{hashlib.sha256(key.encode()).hexdigest()[:16]}/"


def priority_ranges(grants: list[str] | None, keys: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """--tenant-priority KEY=LO:HI grants, by tenant. Raises ValueError naming a bad one."""
    out = {}
    for grant in grants or []:
        key, _, span = grant.rpartition("=")
        if key not in keys:
            raise ValueError("--tenant-priority names a key that is not an --api-key")
        out[tenant_of_key(key)] = parse_range(span)
    return out


def parse_range(span: str) -> tuple[int, int]:
    low, sep, high = span.partition(":")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        raise ValueError(f"a priority range is LO:HI, got {span!r}") from None
    if not sep or lo > hi:
        raise ValueError(f"a priority range is LO:HI with LO <= HI, got {span!r}")
    return lo, hi


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if (handler is None or details.method.startswith(OPEN_PREFIXES)
                or key_of(details.invocation_metadata, self.keys) is not None):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """Ends the call UNAUTHENTICATED as soon as its headers are read. Request-streaming whatever
    the method's kind (a unary request's wire format is the same): grpc.aio runs such a handler
    before any message arrives, where a unary-request one would first wait for the whole
    message, holding the call for as long as the client never sends it."""
    message = "missing or unknown API key: send the metadata `authorization: Bearer <key>`"

    async def unary(requests, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(requests, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as the method's kind needs

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                     handler.response_serializer)
    return grpc.stream_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                handler.response_serializer)


def server_credentials(certfile: str, keyfile: str) -> grpc.ServerCredentials:
    with open(keyfile, "rb") as f:
        key = f.read()
    with open(certfile, "rb") as f:
        cert = f.read()
    return grpc.ssl_server_credentials([(key, cert)])
