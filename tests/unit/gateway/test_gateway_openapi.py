"""The HTTP API's OpenAPI document (gateway/rest/openapi.py) against the gateway that serves it, on
the fake scheduler of tests/fake_scheduler.py: served without a key, valid OpenAPI 3.1 by
schemathesis's own loader, listing exactly the routes the app serves with their methods, and
describing the answers the gateway really sends: whole and streamed, with logprobs, echo,
n > 1, batches, usage, tool calls and errors (schemathesis validates each against its
operation; a streamed answer's events are checked against the chunk models, strict)."""
from __future__ import annotations

import json
import sys

import httpx2 as httpx
import pytest
import schemathesis
from fastapi import FastAPI

from gateway.grammar.grammar_check import GrammarChecker
from gateway.rest.openapi import (ChatCompletionChunk, CompletionChunk, ErrorResponse, OPERATIONS,
                                  document)
from proto import internal_pb2 as ipb
from tests.fake_scheduler import local_gateway, reply_plan
from tests.unit.gateway.test_gateway_api import TOK, logprobs_plan
from tests.unit.gateway.test_gateway_grammar_check import STAND_IN

MODEL = TOK.name
KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Say hello"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_REPLY = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def failing_after_a_token(add) -> list:
    return [reply_plan(TOK)(add)[0], ipb.TokenDelta(
        request_id=add.request_id, finish=ipb.ERROR,
        error=ipb.Error(code="RESOURCE_EXHAUSTED", message="the waiting queue is full"))]


def events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n"), text
    return [json.loads(e[len("data: "):]) for e in text.split("\n\n")[:-2]]


def test_the_document_lists_every_route_with_its_methods_and_nothing_else(run):
    async def body():
        async with local_gateway(TOK, http=True, api_keys=(KEY,)) as h:
            app = h.gateway.http.server.config.app
            async with httpx.AsyncClient() as http:
                r = await http.get(f"http://127.0.0.1:{h.gateway.http_port}/openapi.json")  # no key
            return app, r
    app, r = run(body())
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    schema = schemathesis.openapi.from_dict(doc)
    schema.validate()  # OpenAPI 3.1's own schema
    served = {(route.path_format, m.lower()) for route in app.routes for m in route.methods}
    listed = {(path, m) for path, item in doc["paths"].items() for m in item}
    assert listed == served == set(OPERATIONS)
    # Every keyed operation says so, and answers 401; health and the document need no key.
    open_ = {path for path, item in doc["paths"].items() if "security" not in item["get" if
                                                                                   "get" in item else "post"]}
    assert open_ == {"/health", "/metrics", "/openapi.json"}
    assert all("401" in op["responses"] for path, item in doc["paths"].items()
               for op in item.values() if path not in open_)


def test_the_loader_refuses_a_broken_document():
    """The validation above can fail: the same document with a response's required description
    left out."""
    doc = document(routes_of_an_app(), keyed=False)
    schemathesis.openapi.from_dict(doc).validate()
    del doc["paths"]["/v1/models"]["get"]["responses"]["200"]["description"]
    with pytest.raises(Exception, match="description"):
        schemathesis.openapi.from_dict(doc).validate()


def routes_of_an_app(extra: str | None = None) -> list:
    app = FastAPI()
    for path, method in OPERATIONS:
        app.add_api_route(path, lambda: None, methods=[method.upper()])
    if extra is not None:
        app.add_api_route(extra, lambda: None, methods=["GET"])
    return app.routes


def test_a_route_without_an_entry_fails_the_build():
    with pytest.raises(ValueError, match="/v1/embeddings"):
        document(routes_of_an_app("/v1/embeddings"), keyed=True)


def test_the_answers_are_what_the_document_says(run):
    async def body():
        async with local_gateway(TOK, http=True, api_keys=(KEY,)) as h:
            # An instant stand-in compiler: tools are compiled before a request runs.
            h.gateway.servicer._grammar = GrammarChecker(None, lambda: (0, []), timeout_s=5.0,
                                                         args=[sys.executable, "-c", STAND_IN])
            root = f"http://127.0.0.1:{h.gateway.http_port}"
            async with httpx.AsyncClient(timeout=30) as http:
                doc = (await http.get(f"{root}/openapi.json")).json()
                schema = schemathesis.openapi.from_dict(doc)
                seen, streamed = [], []

                async def send(method: str, path: str, plan=None, doc_path: str | None = None,
                               headers=AUTH, **kw):
                    h.scheduler.plan = plan or reply_plan(TOK)
                    r = await http.request(method, f"{root}{path}", headers=headers, **kw)
                    schema[doc_path or path][method].validate_response(r)
                    seen.append((path, r.status_code))
                    if r.headers.get("content-type", "").startswith("text/event-stream"):
                        streamed.append((path, events(r.text)))
                    return r

                chat = {"model": MODEL, "messages": CHAT}
                cmpl = {"model": MODEL, "prompt": "Say hello"}
                await send("POST", "/v1/chat/completions", logprobs_plan,
                           json={**chat, "logprobs": True, "top_logprobs": 2})
                await send("POST", "/v1/chat/completions", logprobs_plan, json={
                    **chat, "logprobs": True, "top_logprobs": 2, "stream": True,
                    "stream_options": {"include_usage": True}})
                await send("POST", "/v1/chat/completions", json={**chat, "n": 2, "stream": True})
                for stream in (False, True):
                    await send("POST", "/v1/chat/completions", reply_plan(TOK, TOOL_REPLY),
                               json={**chat, "tools": TOOLS, "stream": stream})
                await send("POST", "/v1/completions", logprobs_plan, json={**cmpl, "logprobs": 2})
                await send("POST", "/v1/completions", json={**cmpl, "prompt": ["One", "Two"],
                                                            "n": 2, "echo": True})
                await send("POST", "/v1/completions", json={
                    **cmpl, "prompt": [[1, 2, 3], [4, 5]], "echo": True, "stream": True,
                    "stream_options": {"include_usage": True}})
                await send("POST", "/v1/completions", logprobs_plan,
                           json={**cmpl, "logprobs": 1, "stream": True})
                # an error after the first token: an event, then [DONE]
                await send("POST", "/v1/completions", failing_after_a_token,
                           json={**cmpl, "stream": True, "max_tokens": 5})
                await send("GET", "/v1/models")
                await send("GET", f"/v1/models/{MODEL}", doc_path="/v1/models/{model}")
                await send("GET", "/v1/models/other/model", doc_path="/v1/models/{model}")
                await send("POST", "/tokenize", json={"prompt": "Hello"})
                await send("POST", "/tokenize", json={"messages": CHAT, "tools": TOOLS})
                await send("POST", "/detokenize", json={"tokens": [1, 2, 3]})
                await send("POST", "/detokenize", json={"tokens": [True]})
                await send("POST", "/v1/completions", json={**cmpl, "temperature": -1})
                await send("POST", "/v1/chat/completions", headers={}, json=chat)
                await send("POST", "/v1/completions", content=b"[1, 2]")
                await send("GET", "/health", headers={})
                await send("GET", "/metrics", headers={})
                await send("GET", "/openapi.json", headers={})
            return seen, streamed
    seen, streamed = run(body())
    assert [status for _, status in seen] == [200] * 12 + [404, 200, 200, 200, 400, 400, 401, 400,
                                                           200, 200, 200]
    kinds = []
    for path, chunks in streamed:
        model = ChatCompletionChunk if path == "/v1/chat/completions" else CompletionChunk
        for chunk in chunks:
            kind = ErrorResponse if "error" in chunk else model
            kind.model_validate_json(json.dumps(chunk), strict=True)
            kinds.append(kind)
    assert ErrorResponse in kinds and len(streamed) == 6
    tool_deltas = [c["choices"][0]["delta"].get("tool_calls") for path, chunks in streamed
                   if path == "/v1/chat/completions" for c in chunks if c.get("choices")]
    assert any(tool_deltas)  # the tool-call delta shape was among the answers checked
