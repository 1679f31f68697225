"""HTTP errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the
status codes OpenAI uses for each gRPC status the servicer ends with (gateway/statuses.py)."""
from __future__ import annotations

import logging

from starlette.responses import JSONResponse

from gateway.rest.openai_schema import openai_param
from gateway.statuses import INTERNAL_HTTP, RpcFailed, http_status


class HttpError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param,
                          "code": self.code}}


def from_rpc(e: RpcFailed, chat: bool) -> HttpError:
    status, type_ = http_status(e.code)
    param = openai_param(e.field, chat) if e.field else None
    message = str(e).replace(e.field, param) if e.field and param else str(e)
    return HttpError(status, message, type_, param, e.code.name.lower())


# Two names a client may send for one pagoda field; from_rpc names the first.
_ALIASES = {"response_format": "structured_outputs",   # OpenAI's, vLLM's
            "max_completion_tokens": "max_tokens"}      # chat's, its older name


def as_sent(e: HttpError, body) -> HttpError:
    """e naming the field the client sent, where it sent the other of two names (_ALIASES)."""
    other = _ALIASES.get(e.param)
    if other is None or getattr(body, e.param, None) is not None or getattr(body, other, None) is None:
        return e
    return HttpError(e.status, str(e).replace(e.param, other), e.type, other, e.code)


def bad_request(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, "invalid_request_error", param)


class CatchBugs:
    """ASGI middleware: an exception a route did not turn into an HttpError becomes a 500 in
    OpenAI's shape, logged here, with no detail for the client. Starlette's handler for
    Exception answers too but then raises again, so uvicorn logged the traceback a second time
    and closed the connection: a client's next request on it, kept alive, was reset."""

    def __init__(self, app, log: logging.Logger) -> None:
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, sending)
        except Exception:
            if started:  # a response is half sent: nothing clean can follow, the connection ends
                raise
            self.log.exception("%s %s failed inside the gateway", scope.get("method"), scope.get("path"))
            status, type_ = INTERNAL_HTTP
            body = HttpError(status, "the request failed inside the gateway; see its log", type_).body()
            await JSONResponse(body, status_code=status)(scope, receive, send)
