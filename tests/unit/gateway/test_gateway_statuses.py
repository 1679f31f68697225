"""The one status mapping: every refusal kind ends a gRPC call and an HTTP request with the
status docs/api.md documents, and a bug with INTERNAL / 500 and no detail."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.grammar.grammar_check import CompilerBusy
from gateway.rest.http_errors import from_rpc
from gateway.generation.large_inputs import Busy
from gateway.scheduler_link.scheduler_client import SchedulerBusy, SchedulerUnavailable
from gateway.statuses import REFUSALS, RpcFailed, ending, refused, status_code
from gateway.validation.validation_error import FIELD_METADATA, ValidationError

S = grpc.StatusCode
# (the refusal, its gRPC status, its HTTP status and OpenAI error type), as docs/api.md says.
DOCUMENTED = [
    (ValidationError("stopping.max_tokens", "stopping.max_tokens must be >= 1, got 0"),
     S.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (SchedulerUnavailable("the scheduler at tcp://x is not connected"),
     S.UNAVAILABLE, 503, "service_unavailable_error"),
    (SchedulerBusy("the scheduler is full"), S.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (Busy("large requests are being tokenized; retry later"), S.RESOURCE_EXHAUSTED, 429,
     "rate_limit_error"),
    (CompilerBusy("no grammar compiler was free within 10 s"), S.RESOURCE_EXHAUSTED, 429,
     "rate_limit_error"),
    (RpcFailed(S.ALREADY_EXISTS, "request id in use"), S.ALREADY_EXISTS, 409, "conflict_error"),
    (RpcFailed(S.NOT_FOUND, "no such thing"), S.NOT_FOUND, 404, "not_found_error"),
    (RpcFailed(S.UNAUTHENTICATED, "no key"), S.UNAUTHENTICATED, 401, "authentication_error"),
    (RpcFailed(S.DEADLINE_EXCEEDED, "too late"), S.DEADLINE_EXCEEDED, 504, "timeout_error"),
    (RpcFailed(S.INTERNAL, "the worker failed every step"), S.INTERNAL, 500, "internal_error"),
]


def test_every_refusal_kind_is_documented_here():
    assert set(REFUSALS) <= {type(e) for e, *_ in DOCUMENTED}


@pytest.mark.parametrize("error,code,http,type_", DOCUMENTED, ids=lambda x: type(x).__name__)
def test_a_refusal_has_one_grpc_and_one_http_status(error, code, http, type_):
    failed = refused(error)
    assert (failed.code, str(failed)) == (code, str(error))
    answer = from_rpc(failed, chat=False)
    assert (answer.status, answer.type, answer.code) == (http, type_, code.name.lower())


def test_the_field_at_fault_travels_with_the_status():
    failed = refused(ValidationError("sampling.top_p", "sampling.top_p must be in (0, 1], got 2"))
    assert failed.field == "sampling.top_p"
    answer = from_rpc(failed, chat=False)
    assert (answer.param, str(answer)) == ("top_p", "top_p must be in (0, 1], got 2")


def test_a_bug_is_no_refusal():
    assert refused(KeyError("x")) is None


@pytest.mark.parametrize("name,code", [("RESOURCE_EXHAUSTED", S.RESOURCE_EXHAUSTED),
                                       ("INVALID_ARGUMENT", S.INVALID_ARGUMENT),
                                       ("OK", S.INTERNAL), ("NO_SUCH_CODE", S.INTERNAL)])
def test_the_schedulers_error_codes(name, code):
    assert status_code(name) == code


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self, remaining=None):
        self.remaining, self.metadata, self.ended = remaining, (), None

    def time_remaining(self):
        return self.remaining

    def set_trailing_metadata(self, metadata):
        self.metadata = tuple(metadata)

    async def abort(self, code, details):
        self.ended = (code, details)
        raise _Aborted()


def _end(body, context=None) -> tuple[_Context, list]:
    context, seen = context or _Context(), []

    async def handler():
        async with ending(context, "Tokenize", seen.append):
            body()
    try:
        asyncio.run(handler())
    except (_Aborted, asyncio.CancelledError):
        pass
    return context, seen


def _raise(e):
    def body():
        raise e
    return body


def test_ending_aborts_a_refusal_with_its_status_and_field():
    context, seen = _end(_raise(ValidationError("token_ids[0]", "token_ids[0] = 9 is out of range")))
    assert context.ended == (S.INVALID_ARGUMENT, "token_ids[0] = 9 is out of range")
    assert context.metadata == ((FIELD_METADATA, "token_ids[0]"),) and seen == [S.INVALID_ARGUMENT]


def test_ending_turns_a_bug_into_internal_naming_the_method_only():
    context, seen = _end(_raise(KeyError("secret detail")))
    assert context.ended == (S.INTERNAL, "Tokenize failed inside the gateway; see its log")
    assert context.metadata == () and seen == [S.INTERNAL]


def test_ending_records_ok_and_cancels_without_aborting():
    assert _end(lambda: None)[1] == [S.OK]
    for remaining, code in ((None, S.CANCELLED), (5.0, S.CANCELLED), (0.0, S.DEADLINE_EXCEEDED)):
        context, seen = _end(_raise(asyncio.CancelledError()), _Context(remaining))
        assert context.ended is None and seen == [code]
