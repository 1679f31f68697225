"""The gateway range-checks what the scheduler sends (gateway/scheduler_link/scheduler_checks.py): the gateway
against the fake scheduler on a real ZeroMQ socket and real gRPC. Garbage and bad envelopes are
dropped without touching any stream; a malformed token entry, delta or logprobs entry ends its
own stream with INTERNAL (and aborts it), never another's; a valid request completes afterwards."""
from __future__ import annotations

import asyncio
import functools

import grpc

from gateway.tokenizer import load_tokenizer
from proto import internal_pb2 as ipb, pagoda_pb2 as pb
from proto.columns import pack, pack_f32
from tests.fake_scheduler import local_gateway, logprobs_msg, out, until
from tests.faults.test_faults_delivery import ending

TOK = load_tokenizer("")
harness = functools.partial(local_gateway, TOK)
TOKENS = TOK.encode(" one two three", add_special_tokens=False)
V = TOK.vocab_size


def delta(**kw) -> ipb.TokenDelta:
    return ipb.TokenDelta(**kw)


def column(rid: str, tokens, index: int = 0, offset: int = 1) -> dict:
    return dict(request_ids=[rid], indices=pack([index]), num_tokens=pack([len(tokens)]),
                token_ids=pack(tokens), offsets=pack([offset]))


# name -> (the SchedulerMessage fields for request `rid`, which has one token so far, and what
# the stream's INTERNAL message then names).
MALFORMED = {
    "finish out of range": (lambda rid: dict(deltas=[delta(request_id=rid, finish=7)]),
                            "finish = 7 is not a Finish"),
    "token outside the vocabulary": (lambda rid: column(rid, [V + 5]),
                                     f"token_ids holds token {V + 5}, outside the vocabulary of {V}"),
    "negative token in the columns": (lambda rid: column(rid, [-3]),
                                      "entry 0 of the token columns holds a negative"),
    "negative offset in the columns": (lambda rid: column(rid, TOKENS[1:2], offset=-1),
                                       "entry 0 of the token columns holds a negative"),
    "index past n": (lambda rid: column(rid, TOKENS[1:2], index=3), "index = 3 is outside [0, 0]"),
    "unknown error code": (lambda rid: dict(deltas=[delta(request_id=rid, finish=ipb.ERROR,
                                                          error=ipb.Error(code="BOGUS"))]),
                           "error.code 'BOGUS' is not a status"),
    "ERROR without an error": (lambda rid: dict(deltas=[delta(request_id=rid, finish=ipb.ERROR)]),
                               "finish = ERROR without an error"),
    "absurd prompt_tokens": (lambda rid: dict(deltas=[delta(request_id=rid, prompt_tokens=1 << 30,
                                                            finish=ipb.LENGTH)]),
                             "prompt_tokens = 1073741824 is outside [0, 2048]"),
    "NaN queue time": (lambda rid: dict(deltas=[delta(request_id=rid, queue_time_s=float("nan"))]),
                       "queue_time_s = nan is not a duration"),
    "logprobs of mismatched lengths": (
        lambda rid: dict(logprobs=[logprobs_msg(rid, 1, TOKENS[1:3], [-0.5], [1, 2])]),
        "logprobs columns of 2 tokens, 1 logprobs, 2 ranks"),
    "a positive logprob": (lambda rid: dict(logprobs=[logprobs_msg(rid, 1, TOKENS[1:2], [3.0], [1])]),
                           "logprobs.logprobs holds a value above 0 or NaN"),
    "a rank of 0": (lambda rid: dict(logprobs=[logprobs_msg(rid, 1, TOKENS[1:2], [-1.0], [0])]),
                    "logprobs.ranks holds a rank below 1"),
    "a ragged column": (lambda rid: dict(logprobs=[ipb.Logprobs(request_id=rid, token_ids=b"abc")]),
                        "logprobs: a column of 3 bytes is not a whole number of int32 values"),
}


def first_token_then_wait(add: ipb.AddRequest) -> list:
    return [out(request_id=add.request_id, index=0, token_ids=TOKENS[:1]), None]


async def rest_of(call) -> list[pb.GenerateResponse]:
    out = []
    while (r := await call.read()) is not grpc.aio.EOF:
        out.append(r)
    return out


async def raw(h, peer: bytes, *frames: bytes) -> None:
    await h.scheduler.sock.send_multipart([peer, *frames])


def numbered(h, peer: bytes, **kw) -> bytes:
    """A message numbered as the fake numbers its own, without its offset bookkeeping."""
    h.scheduler.seqs[peer] += 1
    return ipb.SchedulerMessage(epoch=h.scheduler.epoch, seq=h.scheduler.seqs[peer], **kw) \
        .SerializeToString()


def test_garbage_and_bad_envelopes_are_dropped_and_no_stream_notices(run):
    async def body():
        async with harness() as h:
            h.scheduler.plan = first_token_then_wait
            call = h.stub.GenerateStream(pb.GenerateRequest(prompt="x"))
            assert list((await call.read()).token_ids) == TOKENS[:1]
            add = h.scheduler.adds[-1]
            peer = h.scheduler.running[add.request_id].peer
            seq = h.scheduler.seqs[peer]
            bad_info = h.scheduler.info()
            bad_info.vocab_size = 0
            rid = add.request_id
            envelopes = [
                ipb.SchedulerMessage(epoch=0, seq=seq + 1),                       # no epoch
                ipb.SchedulerMessage(epoch=h.scheduler.epoch, seq=0),             # no seq
                ipb.SchedulerMessage(epoch=h.scheduler.epoch, seq=seq,            # a repeat
                                     **column(rid, TOKENS[1:2])),
                ipb.SchedulerMessage(epoch=h.scheduler.epoch, seq=seq + 1, info=bad_info),
                ipb.SchedulerMessage(epoch=h.scheduler.epoch, seq=seq + 1, refused="x" * 10000),
            ]
            for frames in ([b"\xff\xfe garbage"], [b"a", b"b", b"c"], [b""]):
                await raw(h, peer, *frames)
            for msg in envelopes:
                await raw(h, peer, msg.SerializeToString())
            # News for a request this gateway does not know: dropped quietly.
            await raw(h, peer, numbered(h, peer, **column("nobody", TOKENS[:1])))
            await h.scheduler.send_updates(peer, [out(rid, TOKENS[1:], finish=ipb.LENGTH,
                                                      prompt_tokens=1)])
            rest = await rest_of(call)
            dropped = h.gateway.client._bad.total
            print(f"\n{3 + len(envelopes)} garbage frames and bad envelopes dropped ({dropped} "
                  f"counted); the stream went on and finished with all {len(TOKENS)} tokens")
            assert [t for r in rest for t in r.token_ids] == TOKENS[1:]
            assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert dropped == 3 + len(envelopes) and rid not in h.scheduler.aborts
            assert h.gateway.client.info.vocab_size == V  # the bad info was not taken
    run(body())


def test_a_malformed_update_ends_only_its_own_stream_internal(run):
    async def body():
        async with harness() as h:
            h.scheduler.plan = first_token_then_wait
            calls = {}
            for name in [*MALFORMED, "healthy"]:
                call = h.stub.GenerateStream(pb.GenerateRequest(prompt=name))
                assert list((await call.read()).token_ids) == TOKENS[:1]
                calls[name] = (call, h.scheduler.adds[-1].request_id)
            peer = h.scheduler.running[calls["healthy"][1]].peer
            for name, (fields, _) in MALFORMED.items():
                await raw(h, peer, numbered(h, peer, **fields(calls[name][1])))
            for name, (_, why) in MALFORMED.items():
                call, rid = calls[name]
                error = await asyncio.wait_for(ending(call), 5)
                print(f"\n{name}: {error.code().name}: {error.details()}", end="")
                assert error.code() == grpc.StatusCode.INTERNAL
                assert error.details().startswith(
                    "the scheduler sent a malformed update for this request (" + why), error.details()
                await until(lambda: rid in h.scheduler.aborts)
            call, rid = calls["healthy"]
            await h.scheduler.send_updates(peer, [out(rid, TOKENS[1:], finish=ipb.LENGTH,
                                                      prompt_tokens=1)])
            rest = await rest_of(call)
            assert [t for r in rest for t in r.token_ids] == TOKENS[1:]
            # And a new request completes.
            h.scheduler.plan = lambda add: [out(
                request_id=add.request_id, token_ids=TOKENS, finish=ipb.LENGTH)]
            assert [t for r in await h.stream(prompt="y") for t in r.token_ids] == TOKENS
            print(f"\n{len(MALFORMED)} malformed updates: each ended its own stream INTERNAL and "
                  f"was aborted; the healthy stream and a new request completed")
    run(body())


def test_a_malformed_call_reply_fails_that_call_only(run):
    async def body():
        async with harness() as h:
            client = h.gateway.client
            answer = h.scheduler._call

            async def silent(peer, call):  # the fake answers nothing, so the bad reply is the one
                pass
            h.scheduler._call = silent
            task = asyncio.create_task(client.call(ipb.Call(get_loads=True), timeout=5))
            await until(lambda: client._calls)
            call_id = next(iter(client._calls))
            peer = next(iter(h.scheduler.peers))
            reply = ipb.CallReply(call_id=call_id)
            reply.abort.request_ids.append("x" * 5000)
            await raw(h, peer, numbered(h, peer, replies=[reply]))
            try:
                await task
                raise AssertionError("a malformed reply was accepted")
            except Exception as err:  # noqa: BLE001
                e = err
                assert "malformed reply: replies.abort.request_ids[] is 5000 bytes" in str(e), e
            print(f"\nmalformed reply: the call failed with '{e}'; the next call was answered")
            h.scheduler._call = answer
            assert (await h.stub.GetLoads(pb.GetLoadsRequest())) == pb.GetLoadsResponse()
    run(body())
