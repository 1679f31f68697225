"""Exactly-once delivery from the scheduler to a stream: the gateway against the fake scheduler
on a real ZeroMQ socket, which numbers its messages as the real one does (epoch, per-link seq,
per-sequence token offsets). A lost message, a repeated one and a restarted scheduler each end
the stream with UNAVAILABLE at once: never a hang, never a token twice."""
from __future__ import annotations

import asyncio
import functools

import grpc
import pytest
from grpc_health.v1 import health_pb2

from gateway.app import Gateway
from gateway.scheduler_link.inbox import Inbox
from gateway.tokenizer import load_tokenizer
from proto import internal_pb2 as ipb, pagoda_pb2 as pb, pagoda_pb2_grpc
from proto.token_stream import Update
from tests.fake_scheduler import local_gateway, out, until

TOK = load_tokenizer("")
harness = functools.partial(local_gateway, TOK)
TOKENS = TOK.encode(" one two three", add_special_tokens=False)


async def started_stream(h):
    """A stream whose first token arrived; the fake then waits for the test's messages."""
    h.scheduler.plan = lambda add: [out(request_id=add.request_id, index=0,
                                                   token_ids=TOKENS[:1]), None]
    call = h.stub.GenerateStream(pb.GenerateRequest(prompt="x"))
    first = await call.read()
    assert list(first.token_ids) == TOKENS[:1]
    add = h.scheduler.adds[-1]
    return call, add, h.scheduler.running[add.request_id].peer


async def ending(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        while True:
            r = await call.read()
            assert r is not grpc.aio.EOF and not r.token_ids, "no token may arrive after the fault"
    return e.value


def lose_one_message(h, add, peer) -> Update:
    h.scheduler.seqs[peer] += 1  # this number's message never arrives
    return out(request_id=add.request_id, index=0, token_ids=TOKENS[1:2])


def repeat_the_first_token(h, add, peer) -> Update:
    h.scheduler.sent_tokens[(add.request_id, 0)] -= 1  # the first token again
    return out(request_id=add.request_id, index=0, token_ids=TOKENS[:1])


@pytest.mark.parametrize("fault,details", [
    (lose_one_message, "1 messages from the scheduler were lost"),
    (repeat_the_first_token, "index 0: expected output token 1 from the scheduler, got 0: a "
                             "message was lost or repeated"),
], ids=["a-lost-message", "a-repeated-token"])
def test_a_lost_or_repeated_message_ends_the_stream_unavailable_and_aborts_it(run, fault, details):
    """Never a token twice: the stream ends at once, and the gateway aborts the request."""
    async def body():
        async with harness() as h:
            call, add, peer = await started_stream(h)
            await h.scheduler.send_updates(peer, [fault(h, add, peer)])
            error = await asyncio.wait_for(ending(call), 5)
            print(f"\n{fault.__name__}: {error.code().name}: {error.details()}")
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert error.details() == details
            await until(lambda: add.request_id in h.scheduler.aborts)
    run(body())


def test_a_restarted_scheduler_ends_streams_in_flight_and_serves_on(run):
    async def body():
        async with harness() as h:
            call, add, peer = await started_stream(h)
            h.scheduler.epoch += 1  # what a new scheduler process looks like to the gateway
            await h.scheduler.send(peer, ipb.SchedulerMessage(info=h.scheduler.info()))
            error = await asyncio.wait_for(ending(call), 5)
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert error.details() == "the scheduler restarted and lost the requests in flight"
            assert (await h.health_of()) == health_pb2.HealthCheckResponse.SERVING
            h.scheduler.plan = lambda add: [out(
                request_id=add.request_id, token_ids=TOKENS, finish=ipb.LENGTH)]
            assert [r.token_ids for r in await h.stream(prompt="y")][-1] == TOKENS
    run(body())


def test_inbox_merges_plain_tokens_and_bounds_the_rest(run):
    async def body():
        inbox = Inbox("r", limit=5)
        for offset in range(3):
            assert inbox.put(Update("r", 0, offset, [7 + offset]))
        assert inbox.put(Update.of_news(ipb.TokenDelta(request_id="r", prompt_tokens=4)))  # usage
        assert len(inbox) == 4
        merged = await inbox.get()
        assert list(merged.token_ids) == [7, 8, 9] and len(inbox) == 1
        assert inbox.put(Update("r", 0, 3, [10, 11]))
        assert not inbox.put(Update("r", 0, 5, [12, 13, 14]))
        assert inbox.put(Update("r", 0, 8, [15]))  # dropped
        items = [await inbox.get() for _ in range(3)]
        assert [list(i.token_ids) for i in items] == [[], [10, 11], []]
        assert items[2].finish == ipb.ERROR and items[2].news.error.code == "RESOURCE_EXHAUSTED"
        assert items[2].news.error.message == ("the client read too slowly: 3 tokens were waiting "
                                               "unread (--max-unread-deltas 5)")
    run(body())


def test_rpcs_past_the_concurrency_bound_get_resource_exhausted(run):
    async def body():
        async with harness() as h:
            h.scheduler.plan = lambda add: [None]  # streams that stay open
            gateway = Gateway(TOK, h.scheduler.address, port=0, max_concurrent_rpcs=2)
            port = await gateway.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = pagoda_pb2_grpc.GenerationStub(channel)
                    await until(lambda: gateway.client.info is not None)
                    open_calls = [stub.GenerateStream(pb.GenerateRequest(prompt="x")) for _ in range(2)]
                    await until(lambda: len(h.scheduler.adds) == 2)
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stub.Tokenize(pb.TokenizeRequest(prompt="hi"))
                    print(f"\nthird RPC over --max-concurrent-rpcs 2: {e.value.code().name}: "
                          f"{e.value.details()}")
                    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    for call in open_calls:
                        call.cancel()
            finally:
                await gateway.stop(0)
    run(body())
