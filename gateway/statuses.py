"""How every refusal ends a call, in one table for the gRPC and HTTP handlers alike.

A refusal is an exception of a kind named in REFUSALS (a request at fault, a scheduler that is
gone or full, a gateway with no room for large work) or an RpcFailed that names its status
itself. Each kind has one gRPC status; each gRPC status one HTTP status and OpenAI error type
(HTTP_STATUS). Anything else is a bug: INTERNAL (HTTP 500), logged, with no detail for the
client. The gRPC handlers end through `ending`; the HTTP routes turn an RpcFailed into their
error with gateway/rest/http_errors.py `from_rpc`, which reads HTTP_STATUS.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc

from gateway.grammar.grammar_check import CompilerBusy
from gateway.generation.large_inputs import Busy
from gateway.scheduler_link.scheduler_client import SchedulerBusy, SchedulerUnavailable
from gateway.validation.validation_error import FIELD_METADATA, ValidationError

log = logging.getLogger("pagoda.gateway")


class RpcFailed(Exception):
    """Ends an RPC with a status; raised inside the stream, turned into context.abort outside."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str = ""):
        super().__init__(message)
        self.code = code
        self.field = field  # the request field at fault, where one is (HTTP names it as `param`)


# Each kind of refusal the gateway's own code raises, and the status it ends a call with.
REFUSALS: dict[type[Exception], grpc.StatusCode] = {
    ValidationError: grpc.StatusCode.INVALID_ARGUMENT,      # names the field at fault
    SchedulerUnavailable: grpc.StatusCode.UNAVAILABLE,      # not connected, or no answer
    SchedulerBusy: grpc.StatusCode.RESOURCE_EXHAUSTED,      # every sequence it holds in flight
    Busy: grpc.StatusCode.RESOURCE_EXHAUSTED,               # no room for large work in time
    CompilerBusy: grpc.StatusCode.RESOURCE_EXHAUSTED,       # no grammar compiler free in time
}

# Each status a call ends with, as the HTTP status and error type OpenAI uses for it.
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
INTERNAL_HTTP = (500, "internal_error")


def http_status(code: grpc.StatusCode) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of a gRPC status; a status not in the table is a 500."""
    return HTTP_STATUS.get(code, INTERNAL_HTTP)


def refused(e: Exception) -> RpcFailed | None:
    """e as the status it ends a call with; None when e is no refusal (a bug)."""
    if isinstance(e, RpcFailed):
        return e
    for kind, code in REFUSALS.items():
        if isinstance(e, kind):
            return RpcFailed(code, str(e), getattr(e, "field", ""))
    return None


def status_code(name: str) -> grpc.StatusCode:
    """An internal Error.code (a grpc.StatusCode name) as a status; unknown or OK -> INTERNAL."""
    code = grpc.StatusCode.__members__.get(name)
    return code if code is not None and code != grpc.StatusCode.OK else grpc.StatusCode.INTERNAL


def cancel_code(context) -> grpc.StatusCode:
    """Why a call ended without an answer: its deadline passed, else the client cancelled."""
    remaining = context.time_remaining()
    return (grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0
            else grpc.StatusCode.CANCELLED)


class ending:
    """`async with ending(context, "Generate", on_end):` around a gRPC handler's body: the one
    way every handler ends. A refusal aborts the call with its status (and the field at fault
    as trailing metadata), a bug with INTERNAL and the method's name (the traceback goes to the
    log), a cancel or a passed deadline goes on up; on_end gets the status each way, once."""

    def __init__(self, context, method: str, on_end: Callable[[grpc.StatusCode], None]):
        self.context, self.method, self.on_end = context, method, on_end

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind, e, _tb) -> bool:
        if e is None:
            self.on_end(grpc.StatusCode.OK)
            return False
        if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
            self.on_end(cancel_code(self.context))
            return False
        if not isinstance(e, Exception):
            return False  # KeyboardInterrupt, SystemExit: not the call's to answer
        failed = refused(e)
        if failed is None:
            log.error("%s failed", self.method, exc_info=e)
            failed = RpcFailed(grpc.StatusCode.INTERNAL,
                               f"{self.method} failed inside the gateway; see its log")
        self.on_end(failed.code)
        if failed.field:
            self.context.set_trailing_metadata(((FIELD_METADATA, failed.field),))
        await self.context.abort(failed.code, str(failed))
        return False  # not reached: abort raises
