"""What the fuzzers of tests/faults/test_fuzz_api.py found, each kept as a plain regression test
(on the fake scheduler of tests/fake_scheduler.py, no model)."""
from __future__ import annotations

import logging

import grpc
import httpx2 as httpx
import pytest

from proto import pagoda_pb2 as pb
from tests.fake_scheduler import local_gateway, until
from tests.unit.gateway.test_gateway_api import TOK


def test_detokenize_refuses_unknown_fields_and_booleans_as_token_ids(run):
    """schemathesis: /detokenize ignored a field it does not know (the document forbids any),
    and took `true` for the token id 1."""
    async def body():
        async with local_gateway(TOK, http=True) as h:
            url = f"http://127.0.0.1:{h.gateway.http_port}/detokenize"
            async with httpx.AsyncClient() as http:
                extra = await http.post(url, json={"tokens": [1], "skip_special": True})
                boolean = await http.post(url, json={"tokens": [True]})
            return extra, boolean
    extra, boolean = run(body())
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "skip_special", extra.text
    assert boolean.status_code == 400 and boolean.json()["error"]["param"] == "tokens", boolean.text


def test_a_long_role_is_refused_naming_it_not_cut_off_by_the_clients_metadata_limit(run):
    """hypothesis: a 60,000-character role was quoted whole in the status details, which the
    client's gRPC library refuses past its metadata limit: the caller got RESOURCE_EXHAUSTED
    "Stream removed" instead of INVALID_ARGUMENT naming the field."""
    role = "x" * 60_000
    async def body():
        async with local_gateway(TOK) as h:
            errors = []
            for call in (h.stub.Tokenize(pb.TokenizeRequest(
                    messages=[pb.ChatMessage(role=role, content="hi")])),
                    h.stub.Generate(pb.GenerateRequest(
                        messages=[pb.ChatMessage(role=role, content="hi")]))):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                errors.append((e.value.code(), e.value.details()))
            return errors
    for code, details in run(body()):
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith("messages[0].role must be one of") and len(details) < 200


def test_a_client_that_hangs_up_before_the_first_token_is_no_bug_in_the_log(run, caplog):
    """bench/fuzz_api.py, real model: a chat request given up by its client (its deadline)
    before the first token was logged as "failed inside the gateway" with InvalidStateError
    (the request's task was told to cancel but not yet cancelled when its result was read)."""
    async def body():
        async with local_gateway(TOK, http=True) as h:
            h.scheduler.plan = lambda add: []  # nothing comes back
            for extra in ({}, {"stream": True}):
                with pytest.raises(httpx.ReadTimeout):
                    async with httpx.AsyncClient(timeout=0.5) as http:
                        await http.post(f"{h.base_url}/chat/completions", json={
                            "model": TOK.name, "messages": [{"role": "user", "content": "hi"}],
                            **extra})
                await until(lambda: len(h.scheduler.aborts) == len(h.scheduler.adds))
            return len(h.scheduler.aborts)
    assert run(body()) == 2
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "hi", "messages": False}, "messages"),
    ("/tokenize", {"prompt": "hi", "tools": 0}, "tools"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": 1}, "add_special_tokens"),
    ("/v1/chat/completions", {"top_p": True}, "top_p"),
    ("/v1/chat/completions", {"temperature": "0.5"}, "temperature"),
    ("/v1/chat/completions", {"logit_bias": {"5": False}}, "logit_bias"),
])
def test_bodies_the_document_calls_invalid_are_refused(run, path, body, param):
    """schemathesis's invalid bodies (2,000 per route, fake worker): each was answered 200,
    `false` taken for no messages, 1 for true, `true` for 1.0 and "0.5" for 0.5."""
    chat = {"model": TOK.name, "messages": [{"role": "user", "content": "hi"}]}

    async def body_():
        async with local_gateway(TOK, http=True) as h:
            async with httpx.AsyncClient() as http:
                return await http.post(f"http://127.0.0.1:{h.gateway.http_port}{path}",
                                       json={**(chat if path.startswith("/v1") else {}), **body})
    r = run(body_())
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("sampling, field", [
    ({"temperature": 2.5e16}, "sampling.temperature"),
    ({"repetition_penalty": 1.1e15}, "sampling.repetition_penalty"),
    ({"top_k": (1 << 31) - 1}, "sampling.top_k"),
])
def test_sampling_values_the_scheduler_refuses_are_refused_at_the_edge(run, sampling, field):
    """bench/fuzz_api.py, real model: the gateway took a temperature or a repetition_penalty
    past the scheduler's bounds (scheduler/message_checks.py), and the scheduler dropped the
    request as a misbehaving gateway's, with a warning in its log; top_k is bounded there too."""
    async def body():
        async with local_gateway(TOK) as h:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await h.stub.Generate(pb.GenerateRequest(
                    prompt_token_ids=[1, 2], sampling=pb.SamplingParams(**sampling)))
            return e.value.code(), e.value.details(), len(h.scheduler.adds)
    code, details, adds = run(body())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details
    assert adds == 0
