"""OpenAI-compatible HTTP, served by the gateway process next to gRPC on the same event loop.

Every route goes through what gRPC uses: the same servicer core (validation, limits, the
scheduler link, detokenizing, stop strings, aborts), so the two can never disagree. A request
body is read up to --max-http-body-bytes, parsed by the pydantic models of
gateway/rest/openai_schema.py (unknown fields are refused) and translated into GenerateRequests.
Errors take OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the status
codes OpenAI uses. Closing the connection cancels the request, which aborts it at the scheduler
and frees its blocks, as a gRPC cancel does.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator

import grpc
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import metrics
from gateway.grammar import grammar_check
from gateway.rest import http_stream
from gateway.bounds.client_auth import key_of, tenant_of
from gateway.bounds.edge import EdgeConfig
from gateway.rest.json_body import BadBody, parse_object
from gateway.rest.openai_render import Collector, now
from gateway.rest.openapi import document_bytes
from gateway.rest.openai_structured import StructuredBadField, structured_output
from gateway.rest.openai_schema import (BadField, ChatCompletionRequest, CompletionRequest,
                                        chat_request, completion_requests)
from gateway.rest.openai_tools import ToolBadField, ToolConfig, check_tools, tool_request
from gateway.rest.http_errors import CatchBugs, HttpError, as_sent, bad_request, from_rpc
from gateway.rest.http_tokens import detokenize_request, tokenize_json, tokenize_request
from gateway.generation.large_inputs import Busy
from gateway.validation.limits import MAX_N
from gateway.generation.server import GenerationServicer
from gateway.statuses import RpcFailed, http_status, refused
from gateway.validation.validation_error import FIELD_METADATA
from proto import pagoda_pb2
from proto.sizes import MAX_BEAM_WIDTH

log = logging.getLogger("pagoda.gateway")

_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _field_path(loc: tuple) -> str:
    """A pydantic error's location as the client's field path: list indices kept, the names
    pydantic gives a union's branches ("str", "list[TextPart]", "literal['never']") left out."""
    return ".".join(str(part) for part in loc if isinstance(part, int)
                    or (_FIELD.fullmatch(part) and part not in _TYPE_TAGS))


class HttpApi:
    def __init__(self, servicer: GenerationServicer, max_body_bytes: int,
                 edge: EdgeConfig = EdgeConfig()) -> None:
        self.servicer = servicer
        self.edge = edge
        self.tokenizer = servicer.tokenizer
        self.client = servicer.client
        self.max_body_bytes = max_body_bytes
        self.tool_config = ToolConfig(
            parser=edge.tool_call_parser,
            exclude_tools_when_none=edge.exclude_tools_when_tool_choice_none,
            max_spec_bytes=servicer.base_limits.max_structured_output_bytes,
            max_tools=servicer.base_limits.max_tools)
        self.api_keys = servicer.api_keys  # the gRPC side's keys and tenants, as a bearer token
        self.app = FastAPI(title="pagoda", docs_url=None, redoc_url=None, openapi_url=None)
        self.app.add_exception_handler(HttpError, self._on_http_error)
        # No such route or method: OpenAI's shape too, not Starlette's {"detail": ...}.
        self.app.add_exception_handler(StarletteHTTPException, self._on_no_route)
        # A bug must not reach a client as a traceback or a bare 500 page.
        self.app.add_middleware(CatchBugs, log=log)
        route = self.app.add_api_route
        route("/v1/completions", self.completions, methods=["POST"])
        route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        route("/v1/models", self.models, methods=["GET"])
        route("/v1/models/{model:path}", self.model, methods=["GET"])  # ids may hold a "/"
        route("/tokenize", self.tokenize, methods=["POST"])
        route("/detokenize", self.detokenize, methods=["POST"])
        route("/health", self.health, methods=["GET"])
        self.cluster_gauges = metrics.ClusterGauges(self.client)
        route("/metrics", self.metrics, methods=["GET"])
        route("/openapi.json", self.openapi, methods=["GET"])  # no key: gateway/rest/openapi.py says why
        self.openapi_document = document_bytes(self.app.routes, keyed=bool(self.api_keys))

    # ------------------------------------------------------------------ plumbing

    @staticmethod
    async def _on_http_error(_request: Request, e: HttpError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @staticmethod
    async def _on_no_route(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = (f"{request.method} {request.url.path}: "
                   + ("no such route" if e.status_code == 404 else str(e.detail)))
        return JSONResponse(HttpError(e.status_code, message, "invalid_request_error").body(),
                            status_code=e.status_code, headers=e.headers)

    def _tenant(self, request: Request) -> str:
        """With --api-key: the caller's tenant, or 401 for a missing or unknown key."""
        if not self.api_keys:
            return ""
        metadata = [("authorization", request.headers.get("authorization", ""))]
        if key_of(metadata, self.api_keys) is None:
            raise HttpError(401, "missing or unknown API key: send the header "
                                 "`Authorization: Bearer <key>`", "authentication_error",
                            code="invalid_api_key")
        return tenant_of(metadata, self.api_keys)

    async def _json(self, request: Request) -> dict:
        """The body, read up to --max-http-body-bytes, as a JSON object."""
        data = bytearray()
        try:
            async with asyncio.timeout(self.edge.http_body_timeout):
                async for piece in request.stream():
                    data += piece
                    if len(data) > self.max_body_bytes:
                        raise HttpError(413, f"the request body exceeds {self.max_body_bytes} "
                                             "bytes (--max-http-body-bytes)",
                                        "invalid_request_error")
        except TimeoutError:
            raise HttpError(408, f"the request body took more than "
                                 f"{self.edge.http_body_timeout:g} s to arrive "
                                 "(--http-body-timeout)", "invalid_request_error") from None
        try:
            return parse_object(bytes(data))
        except BadBody as e:
            raise bad_request(str(e), e.param) from None

    async def _body(self, request: Request, model: type[pydantic.BaseModel]):
        parsed = await self._json(request)
        try:
            return model.model_validate(parsed)
        except pydantic.ValidationError as e:
            unknown = [_field_path(err["loc"]) for err in e.errors() if err["type"] == "extra_forbidden"]
            if unknown:
                raise bad_request(f"unknown or unsupported field(s): {', '.join(unknown)}",
                                  unknown[0]) from None
            # A union's errors come one per branch, each under the branch's name ("stop.str",
            # "stop.list[str].1"): the field is the path without those names, and the branch
            # that got furthest into the value says best what is wrong with it.
            errors = [(_field_path(err["loc"]), err["msg"]) for err in e.errors()]
            param = errors[0][0]
            where, msg = max((x for x in errors if x[0].startswith(param)), key=lambda x: len(x[0]))
            raise bad_request(f"{where}: {msg}", param or None) from None

    @property
    def model_name(self) -> str:
        info = self.client.info
        return (info.model if info is not None and info.model else "") or self.tokenizer.name

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise HttpError(404, f"The model `{name}` does not exist; this server serves "
                                 f"`{self.model_name}`", "invalid_request_error", "model",
                            "model_not_found")

    async def _generations(self, reqs: list[pagoda_pb2.GenerateRequest], tenant: str, whole: bool
                           ) -> AsyncIterator[tuple[int, pagoda_pb2.GenerateResponse]]:
        """The responses of every request, tagged with its position; one request is the usual
        case, a completions batch runs its prompts side by side. Streamed inside even for a
        whole response: n > 1 needs the stream (unary Generate carries one index). whole: a
        response not streamed to the client (the scheduler may send it whole: GenerationServicer.responses)."""
        started = time.monotonic()
        gens = [self.servicer.responses(r, started, unary=False, tenant=tenant, whole=whole) for r in reqs]
        if len(gens) == 1:
            async with aclosing(gens[0]) as g:
                async for response in g:
                    yield 0, response
            return
        queue: asyncio.Queue = asyncio.Queue(maxsize=64)

        async def pump(i: int, gen) -> None:
            try:
                async with aclosing(gen) as g:
                    async for response in g:
                        await queue.put((i, response, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
                await queue.put((i, None, e))
                return
            await queue.put((i, None, None))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        try:
            left = len(tasks)
            while left:
                i, response, error = await queue.get()
                if error is not None:
                    raise error
                if response is None:
                    left -= 1
                    continue
                yield i, response
        finally:  # a cancel, an error or the end: no generation outlives the HTTP request
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _first(self, gen, chat: bool):
        """The first response, so that an invalid request gets a JSON error, not an event stream."""
        try:
            return await gen.__anext__()
        except StopAsyncIteration:
            return None
        except RpcFailed as e:
            await gen.aclose()
            raise from_rpc(e, chat) from None

    async def _until_disconnect(self, request: Request, coro):
        """Runs coro; a client that hangs up cancels it (which aborts its requests)."""
        task = asyncio.ensure_future(coro)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
                # until the cancel has landed: a task told to cancel is not cancelled yet, and
                # its result() raised InvalidStateError, a 500 logged for every hang-up
                await asyncio.wait({task})
        if task.cancelled():
            return Response(status_code=499)  # nobody is there to read it
        return task.result()

    # ------------------------------------------------------------------ generation

    async def completions(self, request: Request):
        tenant = self._tenant(request)
        body = await self._body(request, CompletionRequest)
        try:
            return await self._generate(request, body, chat=False, tenant=tenant)
        except HttpError as e:
            raise as_sent(e, body) from None

    async def chat_completions(self, request: Request):
        tenant = self._tenant(request)
        body = await self._body(request, ChatCompletionRequest)
        try:
            return await self._generate(request, body, chat=True, tenant=tenant)
        except HttpError as e:
            raise as_sent(e, body) from None

    async def _generate(self, request: Request, body, chat: bool, tenant: str):
        self._check_model(body.model)
        grammar_check.CLIENT.set(request.client.host if request.client else "")  # this request's task
        # Before anything proportional to n is built (the Collector holds n x prompts choices).
        widest = MAX_BEAM_WIDTH if body.use_beam_search else MAX_N
        if not 1 <= body.n <= widest:
            raise bad_request(f"n must be between 1 and {widest}, got {body.n}", "n")
        try:
            reqs = [chat_request(body)] if chat else completion_requests(
                body, self.edge.max_batch_prompts)
            spec = structured_output(body.response_format, body.structured_outputs,
                                     self.edge.structured_outputs_any_whitespace)
            tools, checks = None, []
            if chat:
                tools, spec, checks = tool_request(body, reqs[0], spec, self.tool_config)
        except (BadField, StructuredBadField, ToolBadField) as e:
            raise bad_request(str(e), e.param) from None
        if spec is not None:
            for r in reqs:
                r.sampling.structured_output.CopyFrom(spec)
        try:  # before anything runs: a bad schema gets 400 naming it
            await check_tools(checks, functools.partial(self.servicer.grammar_error, tenant=tenant),
                              self.servicer.grammar_timeout)
        except ToolBadField as e:
            raise bad_request(str(e), e.param) from None
        except RpcFailed as e:
            raise from_rpc(e, chat) from None
        logprobs = body.logprobs if chat else body.logprobs is not None
        echo = None if chat or not body.echo else [
            r.prompt or self.tokenizer.decode(list(r.prompt_token_ids), False) for r in reqs]
        collector = Collector(self.tokenizer, body.n, len(reqs), chat, bool(logprobs), echo, tools)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = now()
        gen = self._generations(reqs, tenant, whole=not body.stream)
        # Watched from here: before its first response (a request queued behind others; a beam
        # search, whose answer comes whole at its end) a client that hangs up aborts it too.
        first = await self._until_disconnect(request, self._first(gen, chat))
        if isinstance(first, Response):  # the client has gone
            await gen.aclose()
            return first
        if not body.stream:
            return await self._until_disconnect(request, http_stream.whole(
                gen, first, collector, rid, created, self.model_name, chat))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = http_stream.events(gen, first, collector, rid, created, self.model_name, chat,
                                    include_usage)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # ------------------------------------------------------------------ the other routes

    async def models(self, request: Request) -> dict:
        self._tenant(request)
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, request: Request, model: str) -> dict:
        """GET /v1/models/{model} (the SDK's models.retrieve)."""
        self._tenant(request)
        self._check_model(model)
        return self._model_card()

    def _model_card(self) -> dict:
        info = self.client.info
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "pagoda",
                "max_model_len": info.max_model_len if info is not None else None}

    async def tokenize(self, request: Request) -> Response:
        self._tenant(request)
        data = await self._json(request)
        if "model" in data:
            self._check_model(data.pop("model"))
        msg = tokenize_request(data)
        reply = await self._unary(self.servicer.Tokenize, msg)
        info = self.client.info
        try:  # off the loop for a large request, as its tokens were counted
            body = await self.servicer.large_jobs.run(
                msg, tokenize_json, reply.token_ids, info.max_model_len if info is not None else None)
        except Busy as e:
            status, type_ = http_status(refused(e).code)
            raise HttpError(status, str(e), type_) from None
        return Response(body, media_type="application/json")

    async def detokenize(self, request: Request) -> dict:
        self._tenant(request)
        data = await self._json(request)
        if "model" in data:
            self._check_model(data.pop("model"))
        reply = await self._unary(self.servicer.Detokenize, detokenize_request(data), "tokens")
        return {"prompt": reply.text}

    async def _unary(self, method, msg, param: str | None = None):
        """A unary gRPC handler of the servicer, its status turned into an HTTP error that
        names param (the route's one input field) when the request was at fault."""
        context = _Context()
        try:
            return await method(msg, context)
        except _Aborted:
            error = from_rpc(RpcFailed(context.code, context.details, context.field), chat=False)
            if error.status == 400 and param is not None:
                error.param = param
            raise error from None

    async def health(self) -> Response:
        info = self.client.info
        ok = info is not None and info.num_workers >= 1
        return Response(status_code=200 if ok else 503)

    async def metrics(self) -> Response:
        """The cluster's gauges only (metrics.ClusterGauges); the gateway's own registry is on
        --gateway-metrics-port."""
        page = await self.cluster_gauges.page()
        if page is None:
            return Response("the scheduler did not answer\n", status_code=503, media_type="text/plain")
        return Response(page, media_type=CONTENT_TYPE_LATEST)

    async def openapi(self) -> Response:
        return Response(self.openapi_document, media_type="application/json")


class _Aborted(Exception):
    pass


class _Context:
    """Enough of a grpc.aio context for the servicer's unary handlers: abort raises; the field
    at fault comes as trailing metadata (gateway/validation/validation_error.py FIELD_METADATA)."""
    code = grpc.StatusCode.OK
    details = ""
    field = ""

    @staticmethod
    def time_remaining() -> None:
        return None  # no deadline: a hang-up cancels the route (gateway/statuses.py cancel_code)

    def set_trailing_metadata(self, metadata) -> None:
        self.field = dict(metadata).get(FIELD_METADATA, "")

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _Aborted()
