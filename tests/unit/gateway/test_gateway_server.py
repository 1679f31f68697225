"""The gateway over real gRPC, against a fake scheduler on a real ZeroMQ ROUTER socket.

The fake answers AddRequests with TokenDeltas cut from real tokenizer encodings, so these tests
pin down the gateway's own logic (streaming, status codes, aborts, health); the full stack with
the real scheduler and workers is tested elsewhere. Real clients (grpcurl, the gateway process)
are in test_gateway_clients.py.
"""
from __future__ import annotations

import asyncio
import functools
import re
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import REGISTRY

from gateway.app import Gateway
from gateway.scheduler_link.scheduler_client import SchedulerClient
from gateway.tokenizer import load_tokenizer
from proto import internal_pb2 as ipb, pagoda_pb2 as pb
from tests.fake_scheduler import (DEFAULT_REPLY as REPLY, FakeScheduler, local_gateway, out,
                                  reply_plan, until, workers_of)

TOK = load_tokenizer("")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
harness = functools.partial(local_gateway, TOK)


def texts_by_index(responses) -> dict[int, str]:
    out: dict[int, str] = {}
    for r in responses:
        out[r.index] = out.get(r.index, "") + r.text
    return out


# ---------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("per_delta", [1, 3])
def test_stream_text_equals_decode(run, per_delta):
    async def body():
        async with harness() as h:
            h.scheduler.plan = reply_plan(TOK, per_delta=per_delta)
            responses = await h.stream(prompt="Say hello", request_id="client-1")
            ids = TOK.encode(REPLY, add_special_tokens=False)
            assert "".join(r.text for r in responses) == TOK.decode(ids) == REPLY
            assert [t for r in responses for t in r.token_ids] == ids
            assert not any("\ufffd" in r.text for r in responses)
            assert {r.request_id for r in responses} == {"client-1"}
            *middle, last = responses
            assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not r.HasField("usage")
                       for r in middle)
            assert last.finish_reason == pb.FINISH_REASON_LENGTH
            assert last.usage == pb.Usage(prompt_tokens=len(TOK.encode("Say hello")),
                                          completion_tokens=len(ids), cached_prompt_tokens=16)
            add = h.scheduler.adds[0]
            # Not guessable, nor the gateway's routing id: 128 random bits.
            assert re.fullmatch(r"[0-9a-f]{32}", add.request_id)
            assert h.gateway.client.gateway_id not in add.request_id
            assert h.scheduler.aborts == []  # finished by the scheduler: nothing to abort
    run(body())


def test_n_completions_and_unary(run):
    async def body():
        async with harness() as h:
            responses = await h.stream(messages=[pb.ChatMessage(role="user", content="hi")],
                                       sampling=pb.SamplingParams(n=3, temperature=0.7))
            assert texts_by_index(responses) == {0: REPLY, 1: REPLY, 2: REPLY}
            lasts = [r for r in responses if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
            assert sorted(r.index for r in lasts) == [0, 1, 2] and all(r.HasField("usage") for r in lasts)
            assert len({r.request_id for r in responses}) == 1 and responses[0].request_id

            one = await h.stub.Generate(pb.GenerateRequest(prompt="hi", request_id="u1"))
            assert (one.request_id, one.text, one.finish_reason) == ("u1", REPLY, pb.FINISH_REASON_LENGTH)
            assert one.usage.completion_tokens == len(one.token_ids) > 0
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await h.stub.Generate(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(n=2)))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.n" in e.value.details()
            assert len({a.request_id for a in h.scheduler.adds}) == 2  # internal ids never repeat
    run(body())


def test_stop_string_finishes_with_stop_and_aborts(run):
    async def body():
        async with harness() as h:
            responses = await h.stream(prompt="x", stopping=pb.StoppingCriteria(stop=["wörld"]))
            assert "".join(r.text for r in responses) == REPLY[:REPLY.index("wörld")]
            assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
            assert responses[-1].usage.completion_tokens == sum(len(r.token_ids) for r in responses)
            await until(lambda: h.scheduler.aborts == [h.scheduler.adds[0].request_id])
    run(body())


def test_stop_string_on_each_of_n_aborts_that_sequence_alone(run):
    async def body():
        async with harness() as h:
            responses = await h.stream(prompt="x", sampling=pb.SamplingParams(n=2),
                                       stopping=pb.StoppingCriteria(stop=["wörld"]))
            assert {r.index for r in responses if r.finish_reason == pb.FINISH_REASON_STOP} == {0, 1}
            await until(lambda: sorted(h.scheduler.abort_indices) == [[0], [1]])
    run(body())


# ---------------------------------------------------------------------------- cancellation


def test_client_cancel_sends_abort(run):
    async def body():
        async with harness() as h:
            h.scheduler.plan = lambda add: [out(request_id=add.request_id,
                                                           token_ids=TOK.encode("Hi")), None]
            call = h.stub.GenerateStream(pb.GenerateRequest(prompt="x"))
            first = await call.read()
            assert first.text == "Hi"
            call.cancel()
            await until(lambda: h.scheduler.aborts == [h.scheduler.adds[0].request_id])
    run(body())


def test_deadline_exceeded_sends_abort(run):
    async def body():
        async with harness() as h:
            h.scheduler.plan = lambda add: [None]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await h.stub.Generate(pb.GenerateRequest(prompt="x"), timeout=0.3)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: h.scheduler.aborts == [h.scheduler.adds[0].request_id])
            await until(lambda: REGISTRY.get_sample_value(
                "pagoda_gateway_requests_total", {"method": "Generate", "code": "DEADLINE_EXCEEDED"}))
    run(body())


# ---------------------------------------------------------------------------- status codes


@pytest.mark.parametrize("request_kw,field", [
    (dict(prompt="hi", stopping=pb.StoppingCriteria(max_tokens=-5)), "stopping.max_tokens"),
    (dict(), "prompt"),
    (dict(prompt="hi", prompt_token_ids=[1]), "prompt_token_ids"),
    (dict(prompt_token_ids=[10**6]), "prompt_token_ids[0]"),
    (dict(prompt="hi", sampling=pb.SamplingParams(top_p=0)), "sampling.top_p"),
    (dict(messages=[pb.ChatMessage(role="robot", content="x")]), "messages[0].role"),
    (dict(prompt="word " * 8000), "max_model_len"),  # > 32 KiB: validated off the loop
])
def test_bad_input_is_invalid_argument(run, request_kw, field):
    async def body():
        async with harness() as h:
            for rpc in (h.stream, lambda **kw: h.stub.Generate(pb.GenerateRequest(**kw))):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await rpc(**request_kw)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert field in e.value.details()
            assert h.scheduler.adds == []
    run(body())


@pytest.mark.parametrize("code,expected", [
    ("RESOURCE_EXHAUSTED", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ("INVALID_ARGUMENT", grpc.StatusCode.INVALID_ARGUMENT),
    ("UNAVAILABLE", grpc.StatusCode.UNAVAILABLE),
    ("NOT_A_CODE", grpc.StatusCode.INTERNAL),  # malformed (gateway/scheduler_link/scheduler_checks.py)
])
def test_error_delta_maps_to_status(run, code, expected):
    async def body():
        async with harness() as h:
            h.scheduler.plan = lambda add: [
                out(request_id=add.request_id, token_ids=TOK.encode("Hi")),
                ipb.TokenDelta(request_id=add.request_id, finish=ipb.ERROR,
                               error=ipb.Error(code=code, message="no room for 9000 blocks"))]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await h.stream(prompt="x")
            assert e.value.code() == expected
            assert e.value.details() == ("no room for 9000 blocks" if code != "NOT_A_CODE" else
                                         "the scheduler sent a malformed update for this request "
                                         "(error.code 'NOT_A_CODE' is not a status)")
    run(body())


def test_health_and_unavailable_until_workers(run):
    async def body():
        async with harness(wait_ready=False, num_workers=0) as h:
            await until(lambda: h.gateway.client.info is not None)
            for service in ("", "pagoda.v1.Generation"):
                assert await h.health_of(service) == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await h.stream(prompt="hi")
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no workers" in e.value.details()
            info = await h.stub.GetModelInfo(pb.GetModelInfoRequest())
            assert info.num_workers == 0 and info.vocab_size == TOK.vocab_size

            await h.scheduler.set_workers(2)
            await until(lambda: workers_of(h.gateway.client) == 2)
            for service in ("", "pagoda.v1.Generation"):
                assert await h.health_of(service) == SERVING
            info = await h.stub.GetModelInfo(pb.GetModelInfoRequest())
            assert (info.model, info.num_workers, info.max_model_len, info.block_size) == \
                (TOK.name, 2, 2048, 16)
            assert list(info.eos_token_ids) == TOK.eos_token_ids
            assert "".join(r.text for r in await h.stream(prompt="hi")) == REPLY
    run(body())


def test_scheduler_that_never_answers_is_unavailable(run):
    async def body():
        async with harness(wait_ready=False, answer_hello=False) as h:
            await until(lambda: h.scheduler.peers)  # hello arrived, went unanswered
            assert await h.health_of() == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await h.stub.Generate(pb.GenerateRequest(prompt="hi"))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    run(body())


def test_lost_scheduler_fails_requests_in_flight(run):
    async def body():
        client = SchedulerClient("", keepalive_interval=0.05, lost_after=0.3)
        async with harness(client=client) as h:
            h.scheduler.plan = lambda add: [None]
            call = h.stub.GenerateStream(pb.GenerateRequest(prompt="x"))
            await until(lambda: h.scheduler.adds)
            h.scheduler.answer_hello = False  # the scheduler goes silent
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert await h.health_of() == NOT_SERVING
    run(body())


def test_liveness_stays_serving_while_readiness_follows_the_scheduler(run):
    """Kubernetes probes readiness on "" and liveness on "liveness" (deploy/k8s): a scheduler
    outage must take the gateway out of the Service, not restart it."""
    async def body():
        client = SchedulerClient("", keepalive_interval=0.05, lost_after=0.3)
        async with harness(client=client) as h:
            assert (await h.health_of(""), await h.health_of("liveness")) == (SERVING, SERVING)
            h.scheduler.answer_hello = False  # the scheduler goes silent
            await until(lambda: h.gateway.client.info is None)  # lost after 0.3 s
            assert await h.health_of("") == NOT_SERVING
            assert await h.health_of("liveness") == SERVING
            h.scheduler.answer_hello = True  # it is back: ready again by itself
            await until(lambda: workers_of(h.gateway.client) >= 1)
            assert await h.health_of("") == SERVING
            await h.gateway.health.enter_graceful_shutdown()  # what stop() does first
            assert await h.health_of("liveness") == NOT_SERVING
    run(body())


def test_readiness_waits_for_the_grammar_checks_compiler_to_be_warm(run):
    """With the warm-up on (gateway.main unless --structured-outputs-lazy), a worker is not
    enough: ready only once the check's child has started (or failed to), so that the first
    request does not share the CPU with its seconds of loading; liveness is SERVING throughout."""
    async def body():
        client = SchedulerClient("", keepalive_interval=0.05, lost_after=5.0)
        async with harness(client=client) as h:
            warming = asyncio.get_running_loop().create_future()
            started = []
            h.gateway.servicer.warm_grammar = lambda: started.append(1) or warming
            h.gateway.warm_grammar = True
            await until(lambda: len(started) >= 3)  # three keepalive answers with a worker
            assert (await h.health_of(""), await h.health_of("liveness")) == (NOT_SERVING, SERVING)
            warming.set_result(None)
            await until(lambda: len(started) >= 4)
            assert await h.health_of("") == SERVING
    run(body())


def test_the_grammar_checks_compiler_is_spawned_before_any_worker_is_known(run):
    """Its imports (seconds of torch and xgrammar) overlap the workers' load: the child is spawned
    as the gateway starts, before the scheduler has said anything; told the vocabulary later."""
    async def body():
        scheduler = FakeScheduler(TOK)
        gateway = Gateway(TOK, scheduler.address, port=0, warm_grammar=True)
        seen = []
        gateway.servicer.spawn_grammar = lambda: seen.append(gateway.client.info)
        try:
            await gateway.start()
            assert seen == [None]
        finally:
            await gateway.stop(0.5)
            await scheduler.close()
    run(body())


def test_tokenize(run):
    async def body():
        async with harness() as h:
            out = await h.stub.Tokenize(pb.TokenizeRequest(prompt="Hello world"))
            assert list(out.token_ids) == TOK.encode("Hello world") and list(out.tokens) == ["Hello", "Ġworld"]
            chat = await h.stub.Tokenize(pb.TokenizeRequest(messages=[pb.ChatMessage(role="user", content="hi")]))
            assert TOK.decode(chat.token_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await h.stub.Tokenize(pb.TokenizeRequest())
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in e.value.details()
    run(body())


def test_concurrent_streams_get_their_own_tokens(run):
    async def body():
        async with harness() as h:
            # Each request's reply is its own prompt, so a delta routed to the wrong stream shows.
            h.scheduler.plan = lambda add: [
                step for t in add.prompt_token_ids
                for step in (0.001, out(request_id=add.request_id, token_ids=[t]))
            ] + [ipb.TokenDelta(request_id=add.request_id, finish=ipb.LENGTH)]
            prompts = [f"request {i}: {'😀' * (i % 3)} {'語' * i}" for i in range(16)]
            results = await asyncio.gather(*(h.stream(prompt=p, request_id=str(i))
                                             for i, p in enumerate(prompts)))
            for i, (prompt, responses) in enumerate(zip(prompts, results)):
                assert "".join(r.text for r in responses) == prompt
                assert {r.request_id for r in responses} == {str(i)}
            assert len({a.request_id for a in h.scheduler.adds}) == 16
    run(body())


def test_scheduler_started_after_the_gateway(run):
    async def body():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        client = SchedulerClient(address)
        gateway = Gateway(TOK, address, port=0, client=client)
        await gateway.start()
        try:
            await asyncio.sleep(0.3)  # hellos go nowhere meanwhile
            assert client.info is None
            scheduler = FakeScheduler(TOK, address=address)
            try:
                await until(lambda: workers_of(client) == 1)
                assert len(scheduler.peers) == 1
            finally:
                await scheduler.close()
        finally:
            await gateway.stop(0)
    run(body())


def test_shutdown_aborts_requests_in_flight(run):
    async def body():
        async with harness() as h:
            h.scheduler.plan = lambda add: [None]
            call = h.stub.GenerateStream(pb.GenerateRequest(prompt="x"))
            await until(lambda: h.scheduler.adds)
            await h.gateway.stop(0.1)
            with pytest.raises(grpc.aio.AioRpcError):
                await call.read()
            await until(lambda: h.scheduler.aborts == [h.scheduler.adds[0].request_id])
    run(body())


def test_a_full_gateway_still_takes_a_tenant_holding_fewer_up_to_twice_its_bound(run):
    """Past the scheduler's bound (ClusterInfo.max_sequences) a tenant holding fewer than another
    may still send: the scheduler pushes out that one's newest waiting request for it. The tenant
    holding most, or one without a name, is refused; nothing passes twice the bound."""
    from gateway.scheduler_link.scheduler_client import SchedulerBusy

    async def body():
        client = SchedulerClient("")
        client.info = ipb.ClusterInfo(max_sequences=4)
        for i in range(4):
            client.open(f"a{i}", tenant="ka/")
        assert not client.has_room() and not client.has_room(tenant="ka/")
        with pytest.raises(SchedulerBusy):
            client.open("a4", tenant="ka/")
        client.open("b0", tenant="kb/")  # b holds 0 of a's 4
        client.open("b1", tenant="kb/")  # 1 + 1 <= 4 - 1
        client.open("b2", tenant="kb/")  # 2 + 1 <= 4 - 1: a's newest gives way, 3 each
        assert not client.has_room(tenant="kb/")  # b would hold 4 to a's 3
        assert not client.has_room(n=2, tenant="kc/")  # nor past twice the bound
        client.open("c0", tenant="kc/")
        assert client._open_sequences == 8 and not client.has_room(tenant="kd/")
        for rid in ("a0", "a1", "a2", "a3", "b0", "b1", "b2", "c0"):
            client.release(rid)
        assert client._open_sequences == 0 and not client._held and not client._tenant_of
    run(body())
