"""The HTTP API's OpenAPI 3.1 document, served at /openapi.json.

Its schemas are pydantic's, from the models the gateway parses requests with
(gateway/rest/openai_schema.py) and, below, models of what it answers (gateway/rest/openai_render.py and
http_stream.py build those as dicts; tests/unit/gateway/test_gateway_openapi.py holds real
answers to these models, and the fuzzer of tests/faults/test_fuzz_api.py every answer it gets).
The paths come from the app's own routes: a route with no entry in OPERATIONS, or an entry
with no route, fails the build, so the document cannot list a route the gateway lacks or miss
one it serves.

The document is served without a key, as vLLM's is: it says only what docs/api.md says (the
request and answer shapes), names no tenant, worker or model, and is built once at start, so
an unauthenticated client gets a constant number of bytes for its request. Clients and tools
(SDK generators, schemathesis) read it before they have a key to send."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, TypeAdapter

from gateway.rest.openai_schema import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                        TokenizeRequest)

OPENAPI_VERSION = "3.1.0"
API_VERSION = "1.0"  # the HTTP API's, /v1
SECURITY_SCHEME = "bearer"  # components.securitySchemes: `Authorization: Bearer <key>`


class _Answer(BaseModel):
    # A key the gateway sends that the document lacks fails the conformance checks.
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------- answers

class ErrorDetail(_Answer):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Answer):
    """Every error, OpenAI's shape; `param` is the field as the client named it."""
    error: ErrorDetail


class PromptTokensDetails(_Answer):
    cached_tokens: int


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # sent when the prefix cache hit


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class CompletionLogprobs(_Answer):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Answer):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None


class Completion(_Answer):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Answer):
    """One event of a streamed completion; the last, with stream_options.include_usage, has no
    choices and the usage."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Answer):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(_Answer):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Answer):
    content: list[TokenLogprob]


class CalledFunctionOut(_Answer):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallOut(_Answer):
    id: str
    type: Literal["function"]
    function: CalledFunctionOut


class AssistantMessage(_Answer):
    role: Literal["assistant"]
    content: str | None  # None: the answer is tool calls alone
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Answer):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None


class ChatCompletion(_Answer):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(_Answer):
    name: str | None = None       # with the call's first delta
    arguments: str


class ToolCallDelta(_Answer):
    index: int
    id: str | None = None         # the call's first delta carries id, type and name
    type: Literal["function"] | None = None
    function: FunctionDelta


class Delta(_Answer):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Answer):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Answer):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Model(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None  # None until the scheduler has answered


class ModelList(_Answer):
    object: Literal["list"]
    data: list[Model]


class TokenizeResponse(_Answer):
    count: int
    tokens: list[int]
    max_model_len: int | None


class DetokenizeResponse(_Answer):
    prompt: str


# ---------------------------------------------------------------------------- operations

ERRORS = {
    400: "A field is malformed or out of range, or the body is not a JSON object; `param` "
         "names the field",
    401: "No key, or an unknown one, in `Authorization: Bearer <key>` (with --api-key)",
    404: "Another model than the one served (`param`: model)",
    408: "The body took longer than --http-body-timeout to arrive",
    409: "The request_id is already in flight",
    413: "The body is larger than --max-http-body-bytes",
    429: "The waiting queue or a quota is full, or this client or API key holds its share of "
         "HTTP connections (--max-http-connections-per-peer, --max-http-connections-per-key); "
         "try again later",
    431: "The request's headers are larger or more than the gateway takes",
    500: "A bug in the gateway (its log has the detail)",
    503: "No worker serves, or the scheduler cannot be reached; or the gateway holds "
         "--max-http-connections connections of clients",
    504: "The request's deadline passed",
}
# Every route may answer these: the header bound and the connection bounds come before routing.
_ANY_ROUTE = (429, 431, 500, 503)
_BODY = (400, 408, 413)
_GENERATION = (*_BODY, 404, 409, 429, 504, *_ANY_ROUTE)


SSE = "text/event-stream"


@dataclass(frozen=True)
class Operation:
    summary: str
    ok: dict                  # the 200's content: media type -> a model, or a schema
    errors: tuple[int, ...]
    body: type | None = None  # the request body's model
    keyed: bool = True        # needs the key when the gateway has keys
    ok_description: str = "OK"
    parameters: tuple[dict, ...] = ()


_STREAMED = ("The whole answer, or with `stream: true` server-sent events: `data: <chunk>` each, "
             "an error event if the request fails after its first token, then `data: [DONE]`")

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("/v1/completions", "post"): Operation(
        "A completion of a prompt, or of each prompt of a batch", body=CompletionRequest,
        ok={"application/json": Completion, SSE: CompletionChunk}, errors=_GENERATION,
        ok_description=_STREAMED),
    ("/v1/chat/completions", "post"): Operation(
        "The assistant's answer to the messages", body=ChatCompletionRequest,
        ok={"application/json": ChatCompletion, SSE: ChatCompletionChunk}, errors=_GENERATION,
        ok_description=_STREAMED),
    ("/v1/models", "get"): Operation(
        "The served model", ok={"application/json": ModelList}, errors=_ANY_ROUTE),
    ("/v1/models/{model}", "get"): Operation(
        "The served model by its id (which may hold a `/`)", ok={"application/json": Model},
        errors=(404, *_ANY_ROUTE),
        parameters=({"name": "model", "in": "path", "required": True,
                     "schema": {"type": "string"}},)),
    ("/tokenize", "post"): Operation(
        "The token ids of a prompt, or of messages as chat renders them", body=TokenizeRequest,
        ok={"application/json": TokenizeResponse}, errors=(*_BODY, 404, 429, *_ANY_ROUTE)),
    ("/detokenize", "post"): Operation(
        "The text of token ids", body=DetokenizeRequest,
        ok={"application/json": DetokenizeResponse}, errors=(*_BODY, 404, 429, *_ANY_ROUTE)),
    ("/health", "get"): Operation(
        "200 while a worker serves, else 503; no body either way", ok={}, errors=(503,),
        keyed=False),
    ("/metrics", "get"): Operation(
        "Prometheus metrics", ok={"text/plain": {"type": "string"}}, errors=_ANY_ROUTE,
        keyed=False),
    ("/openapi.json", "get"): Operation(
        "This document", ok={"application/json": {"type": "object"}}, errors=_ANY_ROUTE,
        keyed=False),
}


def _schemas() -> tuple[dict, dict]:
    """Each model's reference, and the schemas they name: request bodies as pydantic
    validates them, answers as they are written."""
    bodies = {op.body for op in OPERATIONS.values() if op.body is not None}
    answers = {m for op in OPERATIONS.values() for m in op.ok.values() if isinstance(m, type)}
    models = sorted(bodies | answers | {ErrorResponse}, key=lambda m: m.__name__)
    refs, defs = TypeAdapter.json_schemas(
        [(m, "validation" if m in bodies else "serialization", TypeAdapter(m)) for m in models],
        ref_template="#/components/schemas/{model}")
    return {m: schema for (m, _), schema in refs.items()}, defs.get("$defs", {})


def _content(ok: dict, refs: dict) -> dict:
    out = {}
    for media, value in ok.items():
        schema = refs[value] if isinstance(value, type) else value
        if media == SSE:
            # One event, as OpenAPI 3.2 models them ({data, event, id, retry}) and schemathesis
            # reads `schema` for this media type: its data a chunk or an error as JSON text,
            # or the last one's "[DONE]".
            out[media] = {"schema": {"type": "object", "required": ["data"], "properties": {
                "data": {"anyOf": [{"const": "[DONE]"}, {
                    "type": "string", "contentMediaType": "application/json",
                    "contentSchema": {"anyOf": [schema, refs[ErrorResponse]]}}]}}}}
        else:
            out[media] = {"schema": schema}
    return out


def _responses(op: Operation, keyed: bool, refs: dict) -> dict:
    out: dict[str, Any] = {"200": {"description": op.ok_description}}
    if op.ok:
        out["200"]["content"] = _content(op.ok, refs)
    error = {"application/json": {"schema": refs[ErrorResponse]}}
    for status in sorted(set(op.errors) | ({401} if keyed and op.keyed else set())):
        if not op.ok:  # /health: a status alone
            out[str(status)] = {"description": "No worker serves"}
            continue
        out[str(status)] = {"description": ERRORS[status], "content": error}
    return out


def document(routes, keyed: bool) -> dict:
    """The document for the app's routes; keyed: the gateway has --api-key."""
    refs, defs = _schemas()
    served = {(r.path_format, method.lower()) for r in routes if isinstance(r, APIRoute)
              for method in r.methods}
    if served != set(OPERATIONS):
        raise ValueError(f"the OpenAPI document and the routes differ: routes without an entry "
                         f"{sorted(served - set(OPERATIONS))}, entries without a route "
                         f"{sorted(set(OPERATIONS) - served)}")
    paths: dict[str, dict] = {}
    for (path, method), op in OPERATIONS.items():
        entry: dict[str, Any] = {"summary": op.summary,
                                 "operationId": re.sub(r"\W+", "_", f"{method}{path}").strip("_"),
                                 "responses": _responses(op, keyed, refs)}
        if op.parameters:
            entry["parameters"] = list(op.parameters)
        if op.body is not None:
            entry["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": refs[op.body]}}}
        if keyed and op.keyed:
            entry["security"] = [{SECURITY_SCHEME: []}]
        paths.setdefault(path, {})[method] = entry
    out = {"openapi": OPENAPI_VERSION,
           "info": {"title": "pagoda", "version": API_VERSION,
                    "description": "OpenAI's HTTP API (with vLLM's extra fields) as pagoda's "
                                   "gateway serves it; docs/api.md says more."},
           "paths": paths, "components": {"schemas": defs}}
    if keyed:
        out["components"]["securitySchemes"] = {SECURITY_SCHEME: {"type": "http",
                                                                  "scheme": "bearer"}}
    return out


def document_bytes(routes, keyed: bool) -> bytes:
    return json.dumps(document(routes, keyed), separators=(",", ":")).encode()
