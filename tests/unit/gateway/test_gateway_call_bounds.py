"""gateway/bounds/call_bounds.py and the refusal of calls without a key (gateway/bounds/client_auth.py), against
an in-process gateway and a fake scheduler: calls are bounded per peer and in total from their
headers on, health is never counted, a call's request must arrive within the deadline, and a
call without a key is refused before its message."""
from __future__ import annotations

import asyncio
import contextlib
import time
import types

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.app import Gateway
from gateway.bounds.call_bounds import GENERATION_PREFIX, CallSlots, peer_host
from gateway.bounds.client_auth import ApiKeyInterceptor
from gateway.bounds.edge import EdgeConfig
from gateway.validation.validation_error import FIELD_METADATA
from gateway.tokenizer import load_tokenizer
from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.fake_scheduler import FakeScheduler, until, workers_of

TOK = load_tokenizer("")
KEY = "the-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
FIRST_MESSAGE_TIMEOUT = 0.5
GENERATE = GENERATION_PREFIX + "Generate"


def test_peer_host_drops_the_port_and_keeps_the_address():
    assert peer_host("ipv4:127.0.0.2:51234") == "127.0.0.2"
    assert peer_host("ipv6:[::1]:51234") == "::1"
    assert peer_host("ipv6:%5B::ffff:10.0.0.7%5D:443") == "::ffff:10.0.0.7"
    assert peer_host("unix:/tmp/s") == "unix:/tmp/s"


def test_slots_bound_each_peer_and_the_total_and_come_back():
    slots = CallSlots(total=3, per_peer=2)
    assert slots.take("a") is None and slots.take("a") is None
    assert slots.take("a") == ("this client (a) has 2 calls in flight, the most one address may "
                               "have (--max-rpcs-per-peer); retry once one has ended")
    assert slots.take("b") is None
    assert slots.take("c") == ("the gateway has 3 calls in flight, the most it serves at once "
                               "(--max-concurrent-rpcs); retry later")
    slots.give_back("a")
    assert slots.take("c") is None
    for host in ("a", "b", "c"):
        slots.give_back(host)
    assert slots.in_flight == 0 and not slots.by_peer


@contextlib.asynccontextmanager
async def gateway(per_peer: int = 2, total: int | None = 3, api_keys=(KEY,)):
    global _stopped
    _stopped = asyncio.Event()
    scheduler = FakeScheduler(TOK)
    gw = Gateway(TOK, scheduler.address, port=0, api_keys=api_keys, max_concurrent_rpcs=total,
                 edge=EdgeConfig(max_rpcs_per_peer=per_peer,
                                 grpc_first_message_timeout=FIRST_MESSAGE_TIMEOUT))
    port = await gw.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        await until(lambda: workers_of(gw.client) >= 1)
        yield gw, channel
    finally:
        _stopped.set()
        await channel.close()
        await gw.stop(0.5)
        await scheduler.close()


# Set when a test's gateway stops: the half-open calls' request iterators end with it.
_stopped: asyncio.Event | None = None


async def half_open_requests():
    """Request messages that never come (until the test's gateway stops)."""
    await _stopped.wait()
    return
    yield  # pragma: no cover - an async generator that yields nothing


def half_open(channel, method: str = GENERATE, metadata=AUTH, response=pb.GenerateResponse):
    """A call on `method` that sends its headers and never its message (as a stream, which a
    unary request is on the wire)."""
    call = channel.stream_unary(method, request_serializer=lambda m: m.SerializeToString(),
                                response_deserializer=response.FromString)
    return call(half_open_requests(), metadata=metadata)


async def status_of(call) -> tuple[grpc.StatusCode, str, float]:
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    return e.value.code(), e.value.details(), time.monotonic() - started


def test_the_refusal_of_a_call_without_a_key_never_waits_for_its_message(run):
    """grpc.aio runs a request-streaming handler at once, a unary-request one only once the
    whole message is in: the refusal is request-streaming whatever the method's kind."""
    async def main():
        servicer = pagoda_pb2_grpc.GenerationServicer()
        for kind in (grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler):
            handler = kind(servicer.Generate, pb.GenerateRequest.FromString,
                           pb.GenerateResponse.SerializeToString)

            async def continuation(_details, handler=handler):
                return handler
            details = types.SimpleNamespace(method=GENERATE, invocation_metadata=())
            refusal = await ApiKeyInterceptor((KEY,)).intercept_service(continuation, details)
            assert refusal.request_streaming
            assert refusal.response_streaming == handler.response_streaming
    run(main())


def test_a_call_without_a_key_is_refused_before_its_message(run):
    async def main():
        async with gateway() as (gw, channel):
            for metadata in ((), (("authorization", "Bearer wrong"),)):
                code, details, took = await status_of(half_open(channel, metadata=metadata))
                assert code == grpc.StatusCode.UNAUTHENTICATED and took < FIRST_MESSAGE_TIMEOUT
                assert details.startswith("missing or unknown API key")
            # and its streaming kind too
            stream = channel.stream_stream(GENERATION_PREFIX + "GenerateStream")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stream(iter(())):
                    pass
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert gw.slots.in_flight == 0
    run(main())


def test_a_call_whose_message_never_comes_ends_at_the_deadline_and_frees_its_slot(run):
    async def main():
        async with gateway() as (gw, channel):
            call = half_open(channel)
            await until(lambda: gw.slots.in_flight == 1)
            code, details, took = await status_of(call)
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert details == ("no request message within 0.5 s of the call's headers "
                               "(--grpc-first-message-timeout)")
            assert took < FIRST_MESSAGE_TIMEOUT + 1
            await until(lambda: gw.slots.in_flight == 0)
            # Health's own unary calls get the same deadline, without a slot.
            code, _, _ = await status_of(half_open(channel, "/grpc.health.v1.Health/Check", (),
                                                   health_pb2.HealthCheckResponse))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED
            # And reflection's, a request stream, for its first message; then it serves.
            reflect = channel.stream_stream(
                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in reflect(half_open_requests()):
                    pass
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - started < FIRST_MESSAGE_TIMEOUT + 1
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = [r async for r in stub.ServerReflectionInfo(iter(
                [reflection_pb2.ServerReflectionRequest(list_services="")]))]
            assert GENERATION_PREFIX.strip("/") in {
                s.name for s in replies[0].list_services_response.service}
    run(main())


def test_calls_past_the_peers_share_are_refused_and_health_still_answers(run):
    async def main():
        async with gateway(per_peer=2, total=3) as (gw, channel):
            held = [half_open(channel) for _ in range(2)]
            await until(lambda: gw.slots.in_flight == 2)
            code, details, took = await status_of(half_open(channel))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and took < FIRST_MESSAGE_TIMEOUT
            assert details.startswith("this client (127.0.0.1) has 2 calls in flight")
            with pytest.raises(grpc.aio.AioRpcError) as e:  # a whole call is refused as well
                await pagoda_pb2_grpc.GenerationStub(channel).Tokenize(
                    pb.TokenizeRequest(prompt="hi"), metadata=AUTH)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", "liveness"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=1)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            for call in held:
                call.cancel()
            await until(lambda: gw.slots.in_flight == 0)
            reply = await pagoda_pb2_grpc.GenerationStub(channel).Tokenize(
                pb.TokenizeRequest(prompt="hi"), metadata=AUTH)
            assert list(reply.token_ids) == TOK.encode("hi")
    run(main())


def test_calls_past_the_total_are_refused(run):
    async def main():
        async with gateway(per_peer=5, total=2, api_keys=()) as (gw, channel):
            held = [half_open(channel, metadata=()) for _ in range(2)]
            await until(lambda: gw.slots.in_flight == 2)
            code, details, _ = await status_of(half_open(channel, metadata=()))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert details == ("the gateway has 2 calls in flight, the most it serves at once "
                               "(--max-concurrent-rpcs); retry later")
            for call in held:
                call.cancel()
            await until(lambda: gw.slots.in_flight == 0)
    run(main())


def test_the_wrapped_handlers_behave_as_before(run):
    """Unary and streaming answers, a refusal's status and trailing metadata, a message that is
    not protobuf, a call that ends without its message; each slot is back afterwards."""
    async def main():
        async with gateway(per_peer=4, total=4) as (gw, channel):
            stub = pagoda_pb2_grpc.GenerationStub(channel)
            whole = await stub.Generate(pb.GenerateRequest(prompt="hi"), metadata=AUTH)
            parts = [r async for r in stub.GenerateStream(pb.GenerateRequest(prompt="hi"),
                                                          metadata=AUTH)]
            assert whole.token_ids and [t for p in parts for t in p.token_ids] == list(whole.token_ids)
            call = stub.Detokenize(pb.DetokenizeRequest(token_ids=[TOK.vocab_size + 5]),
                                   metadata=AUTH)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert tuple(await call.trailing_metadata()) == ((FIELD_METADATA, "token_ids[0]"),)
            raw = channel.unary_unary(GENERATE)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await raw(b"\xff\xff\xff", metadata=AUTH)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details() == "request: not a valid protobuf message of this method's type"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await channel.stream_unary(GENERATE)(iter(()), metadata=AUTH)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details() == "request: the call ended without its request message"
            await until(lambda: gw.slots.in_flight == 0)
    run(main())
