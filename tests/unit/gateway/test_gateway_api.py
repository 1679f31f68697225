"""The gateway's assembly of the public response fields (logprobs, prompt extras, matched_stop,
seed, metrics) and its smaller RPCs (Abort, GetLoads, Tokenize, Detokenize), over real gRPC
against the fake scheduler of tests/fake_scheduler.py: no model, no workers."""
from __future__ import annotations

import functools
import re
import socket

import grpc
import pytest
from tokenizers import Tokenizer, processors

from gateway.app import Gateway
from gateway.generation.response_builder import token_logprobs
from gateway.tokenizer import TextTokenizer, load_tokenizer
from proto import internal_pb2 as ipb, pagoda_pb2 as pb, pagoda_pb2_grpc
from proto.token_stream import Update
from tests.fake_scheduler import (DEFAULT_REPLY as REPLY, local_gateway, logprobs_msg, out,
                                  reply_plan, until)

TOK = load_tokenizer("")
harness = functools.partial(local_gateway, TOK)
REPLY_IDS = TOK.encode(REPLY, add_special_tokens=False)
UNSET = pb.FINISH_REASON_UNSPECIFIED


def lasts(responses) -> dict[int, pb.GenerateResponse]:
    return {r.index: r for r in responses if r.finish_reason != UNSET}


def text_of(responses, index: int = 0) -> str:
    return "".join(r.text for r in responses if r.index == index)


def delta(add, ids=(), index=0, finish=ipb.NOT_FINISHED, **kw) -> Update:
    if finish != ipb.NOT_FINISHED:
        kw.setdefault("prompt_tokens", len(add.prompt_token_ids))
    return out(request_id=add.request_id, index=index, token_ids=ids, finish=finish, **kw)


async def expect_error(rpc, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await rpc
    assert e.value.code() == code, e.value.details()
    return e.value.details()


# ---------------------------------------------------------------------------- logprobs

# "Hi 😀 there": the emoji's first bytes are one token (held back by the detokenizer), its last
# byte the next.
LP_IDS = TOK.encode("Hi 😀 there", add_special_tokens=False)
LP_VALUES = [-0.25 * (j + 1) for j in range(len(LP_IDS))]
LP_TOP = [t for j, tid in enumerate(LP_IDS) for t in (tid, 1000 + j)]  # k = 2, best first
LP_TOP_VALUES = [v for j in range(len(LP_IDS)) for v in (LP_VALUES[j], LP_VALUES[j] - 1.5)]


def expected_logprobs() -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(
        token_id=t, logprob=LP_VALUES[j], rank=j + 1, text=TOK.token_text(t),
        token_bytes=TOK.token_bytes(t),
        top_logprobs=[pb.TopLogprob(token_id=u, logprob=v, text=TOK.token_text(u))
                      for u, v in zip(LP_TOP[2 * j:2 * j + 2], LP_TOP_VALUES[2 * j:2 * j + 2])])
        for j, t in enumerate(LP_IDS)]


def logprobs_plan(add):
    p = len(add.prompt_token_ids)

    def scores(lo, hi):  # output positions lo..hi-1, at sequence positions p + lo ...
        return logprobs_msg(add.request_id, p + lo, LP_IDS[lo:hi], LP_VALUES[lo:hi],
                            [j + 1 for j in range(lo, hi)], LP_TOP[2 * lo:2 * hi],
                            LP_TOP_VALUES[2 * lo:2 * hi], k=2)
    # One Logprobs message spans two deltas; the next delta's message comes separately.
    return [scores(0, 3), delta(add, LP_IDS[0:2]), delta(add, LP_IDS[2:3]), scores(3, 4),
            delta(add, LP_IDS[3:4], finish=ipb.LENGTH)]


def test_logprobs_line_up_with_tokens(run):
    async def body():
        async with harness() as h:
            h.scheduler.plan = logprobs_plan
            request = dict(prompt="Say hello", sampling=pb.SamplingParams(logprobs=2))
            responses = await h.stream(**request)
            assert [r.text for r in responses] == ["Hi", " 😀", " there"]
            assert [list(r.token_ids) for r in responses] == [LP_IDS[0:2], LP_IDS[2:3], LP_IDS[3:4]]
            assert [len(r.logprobs) for r in responses] == [2, 1, 1]
            assert [lp for r in responses for lp in r.logprobs] == expected_logprobs()
            held = responses[0].logprobs[1]  # the emoji's first bytes: text shows U+FFFD
            assert (held.text, held.token_bytes) == (" \ufffd", " 😀".encode()[:4])

            one = await h.stub.Generate(pb.GenerateRequest(**request))
            assert (one.text, list(one.token_ids)) == ("Hi 😀 there", LP_IDS)
            assert list(one.logprobs) == expected_logprobs()
    run(body())


def test_prompt_logprobs_and_ids_on_index_0_first_message(run):
    async def body():
        async with harness() as h:
            def plan(add):
                prompt = list(add.prompt_token_ids)
                scores = logprobs_msg(add.request_id, 1, prompt[1:], [-1.0] * (len(prompt) - 1),
                                      [3] * (len(prompt) - 1), [7] * (len(prompt) - 1),
                                      [-0.5] * (len(prompt) - 1), k=1, prompt=True)
                return [scores, *reply_plan(TOK, text="ok then")(add)]
            h.scheduler.plan = plan
            responses = await h.stream(prompt="Once upon a time", return_prompt_token_ids=True,
                                       sampling=pb.SamplingParams(n=2, prompt_logprobs=1))
            prompt = TOK.encode("Once upon a time")
            first = next(i for i, r in enumerate(responses) if r.index == 0)
            assert list(responses[first].prompt_token_ids) == prompt
            assert list(responses[first].prompt_logprobs) == [pb.TokenLogprob(
                token_id=t, logprob=-1.0, rank=3, text=TOK.token_text(t), token_bytes=TOK.token_bytes(t),
                top_logprobs=[pb.TopLogprob(token_id=7, logprob=-0.5, text=TOK.token_text(7))])
                for t in prompt[1:]]
            others = [r for i, r in enumerate(responses) if i != first]
            assert {r.index for r in others} == {0, 1}
            assert not any(r.prompt_token_ids or r.prompt_logprobs or r.logprobs for r in others)
    run(body())


def test_malformed_logprobs_columns_are_refused():
    # k = 2 for 2 tokens: 4 top ids, but only 3 top logprobs.
    lp = logprobs_msg("r", 5, [10, 11], [-1.0, -2.0], [1, 2], [10, 12, 11, 13], [-1.0, -2.0, -2.0], k=2)
    with pytest.raises(ValueError, match="do not line up"):
        token_logprobs(TOK, lp)


# ---------------------------------------------------------------------------- matched_stop

STOP_AT = REPLY.index("wörld")


@pytest.mark.parametrize("finish,stopping,text,kind,value", [
    (ipb.STOP, {}, REPLY, "matched_token_id", REPLY_IDS[-1]),
    (ipb.LENGTH, dict(stop=["wörld"]), REPLY[:STOP_AT], "matched_stop_str", "wörld"),
    (ipb.LENGTH, dict(stop=["wörld"], include_stop_str_in_output=True),
     REPLY[:STOP_AT + len("wörld")], "matched_stop_str", "wörld"),
    (ipb.LENGTH, {}, REPLY, None, None),
], ids=["eos", "stop-string", "include-stop-string", "length"])
def test_matched_stop(run, finish, stopping, text, kind, value):
    async def body():
        async with harness() as h:
            h.scheduler.plan = reply_plan(TOK, finish=finish)
            responses = await h.stream(prompt="x", stopping=pb.StoppingCriteria(**stopping))
            last = responses[-1]
            assert text_of(responses) == text
            assert last.finish_reason == (pb.FINISH_REASON_LENGTH if kind is None else pb.FINISH_REASON_STOP)
            assert last.WhichOneof("matched_stop") == kind
            if kind is not None:
                assert getattr(last, kind) == value
            assert not any(r.WhichOneof("matched_stop") for r in responses[:-1])
    run(body())


def test_stop_string_before_min_tokens_does_not_stop(run):
    async def body():
        async with harness() as h:
            # "Héllo" ends at output token 3, " done" is token 24.
            responses = await h.stream(prompt="x", stopping=pb.StoppingCriteria(
                stop=["Héllo", "done"], min_tokens=5))
            assert text_of(responses) == REPLY[:REPLY.index("done")]
            assert responses[-1].matched_stop_str == "done"
    run(body())


def test_stop_string_completed_at_min_tokens_stops(run):
    async def body():
        async with harness() as h:
            # "Héllo" is output tokens 1-3 ("H", "é", "llo"): complete once 3 tokens exist.
            responses = await h.stream(prompt="x", stopping=pb.StoppingCriteria(
                stop=["Héllo"], min_tokens=3))
            assert (text_of(responses), responses[-1].matched_stop_str) == ("", "Héllo")
    run(body())


# ---------------------------------------------------------------------------- seed and metrics


@pytest.mark.parametrize("seed", [None, 7])
def test_seed_and_metrics_on_each_index_last_message(run, seed):
    async def body():
        async with harness() as h:
            h.scheduler.plan = lambda add: [
                d for i in range(2) for d in (
                    delta(add, REPLY_IDS[:3], index=i),
                    delta(add, REPLY_IDS[3:6], index=i, finish=ipb.LENGTH, queue_time_s=0.25,
                          num_preemptions=2))]
            sampling = pb.SamplingParams(n=2) if seed is None else pb.SamplingParams(n=2, seed=seed)
            responses = await h.stream(prompt="x", sampling=sampling)
            drawn = h.scheduler.adds[0].sampling.seed
            assert h.scheduler.adds[0].sampling.has_seed
            if seed is not None:
                assert drawn == seed
            final = lasts(responses)
            assert {i: r.seed for i, r in final.items()} == {0: drawn, 1: drawn + 1}
            for r in final.values():
                m = r.metrics
                assert r.HasField("metrics") and (m.queue_time_s, m.num_preemptions) == (0.25, 2)
                assert m.e2e_time_s >= m.time_to_first_token_s >= 0
            middle = [r for r in responses if r.finish_reason == UNSET]
            assert len(middle) == 2
            assert not any(r.HasField("seed") or r.HasField("metrics") for r in middle)
    run(body())


@pytest.mark.parametrize("skip,text", [(None, "Hi there"), (False, "Hi<|im_start|> there")])
def test_skip_special_tokens(run, skip, text):
    async def body():
        async with harness() as h:
            ids = [*TOK.encode("Hi", add_special_tokens=False), 1, *TOK.encode(" there", add_special_tokens=False)]
            h.scheduler.plan = lambda add: [delta(add, ids, finish=ipb.LENGTH)]
            kw = {} if skip is None else dict(skip_special_tokens=skip)
            responses = await h.stream(prompt="x", **kw)
            assert (text_of(responses), [t for r in responses for t in r.token_ids]) == (text, ids)
    run(body())


# ---------------------------------------------------------------------------- Abort, GetLoads


def test_abort_reaches_a_stream_on_another_gateway(run):
    async def body():
        async with harness() as h1, harness(scheduler=h1.scheduler) as h2:
            h1.scheduler.plan = lambda add: [delta(add, TOK.encode("Hi"), index=i) for i in range(2)] + [None]
            call = h2.stub.GenerateStream(pb.GenerateRequest(
                prompt="x", request_id="job-7", sampling=pb.SamplingParams(n=2)))
            assert (await call.read()).text == "Hi"
            reply = await h1.stub.Abort(pb.AbortRequest(request_ids=["ghost", "job-7", "job-7"]))
            assert list(reply.request_ids) == ["job-7"]
            rest = []
            while (r := await call.read()) is not grpc.aio.EOF:
                rest.append(r)
            assert {i: r.finish_reason for i, r in lasts(rest).items()} == {
                0: pb.FINISH_REASON_ABORT, 1: pb.FINISH_REASON_ABORT}
            assert all(r.usage.prompt_tokens == len(TOK.encode("x")) for r in lasts(rest).values())
            assert h1.scheduler.aborts == []  # ended by the scheduler: nothing left to abort
            details = await expect_error(h1.stub.Abort(pb.AbortRequest()), grpc.StatusCode.INVALID_ARGUMENT)
            assert "request_ids" in details
            assert [c.WhichOneof("kind") for c in h1.scheduler.calls] == ["abort"]
    run(body())


def test_abort_and_get_loads_without_a_scheduler_are_unavailable(run):
    async def body():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
        gateway = Gateway(TOK, address, port=0)
        port = await gateway.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            stub = pagoda_pb2_grpc.GenerationStub(channel)
            await expect_error(stub.Abort(pb.AbortRequest(request_ids=["a"])), grpc.StatusCode.UNAVAILABLE)
            await expect_error(stub.GetLoads(pb.GetLoadsRequest()), grpc.StatusCode.UNAVAILABLE)
        finally:
            await channel.close()
            await gateway.stop(0)
    run(body())


def test_duplicate_request_id_is_already_exists(run):
    async def body():
        async with harness() as h:
            h.scheduler.plan = lambda add: [delta(add, TOK.encode("Hi")), None]
            call = h.stub.GenerateStream(pb.GenerateRequest(prompt="x", request_id="dup"))
            assert (await call.read()).text == "Hi"
            details = await expect_error(h.stream(prompt="y", request_id="dup"),
                                         grpc.StatusCode.ALREADY_EXISTS)
            assert "'dup'" in details
            call.cancel()
            await until(lambda: h.scheduler.adds[0].request_id in h.scheduler.aborts)
    run(body())


def test_get_loads_returns_the_scheduler_answer_naming_no_host_or_pid(run):
    async def body():
        async with harness() as h:
            h.scheduler.loads = pb.GetLoadsResponse(num_pending=4, workers=[
                pb.WorkerLoad(worker_id="host-a-4711", running=3, waiting=2, swapped=1,
                              kv_blocks_used=50, kv_blocks_total=200, prefix_cache_hit_rate=0.5),
                pb.WorkerLoad(worker_id="host-b-4712", kv_blocks_total=200)])
            got = await h.stub.GetLoads(pb.GetLoadsRequest())
            again = await h.stub.GetLoads(pb.GetLoadsRequest())
            labels = [w.worker_id for w in got.workers]
            assert [w.worker_id for w in again.workers] == labels  # stable per worker
            assert len(set(labels)) == 2 and all(re.fullmatch(r"worker-[0-9a-f]{12}", x) for x in labels)
            for w in got.workers:
                w.worker_id = ""
            for w in h.scheduler.loads.workers:
                w.worker_id = ""
            assert got == h.scheduler.loads  # the rest as the scheduler said
    run(body())


# ---------------------------------------------------------------------------- Tokenize, Detokenize


def test_detokenize(run):
    async def body():
        async with harness() as h:
            prompt = "Héllo 😀 wörld"
            ids = (await h.stub.Tokenize(pb.TokenizeRequest(prompt=prompt))).token_ids
            assert (await h.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids))).text == prompt
            special = [1, *ids]
            assert (await h.stub.Detokenize(pb.DetokenizeRequest(token_ids=special))).text == prompt
            out = await h.stub.Detokenize(pb.DetokenizeRequest(token_ids=special, skip_special_tokens=False))
            assert out.text == "<|im_start|>" + prompt
            details = await expect_error(h.stub.Detokenize(pb.DetokenizeRequest(
                token_ids=[5, TOK.vocab_size - 1, TOK.vocab_size])), grpc.StatusCode.INVALID_ARGUMENT)
            assert details.startswith("token_ids[2]")
    run(body())


def test_tokenize_offsets_slice_the_prompt(run):
    async def body():
        async with harness() as h:
            prompt = "Hello wörld 😀 done, ok?"
            out = await h.stub.Tokenize(pb.TokenizeRequest(prompt=prompt))
            assert out.prompt == prompt and list(out.token_ids) == TOK.encode(prompt)
            assert len(out.offsets) == len(out.token_ids)
            ascii_ids = [(t, o) for t, o in zip(out.token_ids, out.offsets) if TOK.token_bytes(t).isascii()]
            assert len(ascii_ids) == 7
            for token_id, o in ascii_ids:
                assert prompt[o.start:o.end] == TOK.token_text(token_id)
            assert out.offsets[-1].end == len(prompt)
    run(body())


def _with_bos(tok: TextTokenizer) -> TextTokenizer:
    """The test tokenizer with a post-processor that adds a BOS, so add_special_tokens shows."""
    raw = Tokenizer.from_str(tok.tokenizer.to_str())
    raw.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", 0)])
    return TextTokenizer(tokenizer=raw, name=tok.name, bos_token="<|endoftext|>",
                         eos_token=tok.eos_token, chat_template=tok.chat_template,
                         eos_token_ids=tok.eos_token_ids)


def test_tokenize_messages_renders_the_chat_without_special_tokens(run):
    async def body():
        bos_tok = _with_bos(TOK)
        async with local_gateway(bos_tok) as h:
            assert (await h.stub.Tokenize(pb.TokenizeRequest(prompt="hi"))).token_ids[0] == 0
            messages = [pb.ChatMessage(role="user", content="hi")]
            rendered = bos_tok.render_chat([{"role": "user", "content": "hi"}])
            out = await h.stub.Tokenize(pb.TokenizeRequest(messages=messages))
            assert out.prompt == rendered
            assert list(out.token_ids) == bos_tok.encode(rendered, add_special_tokens=False)
            out = await h.stub.Tokenize(pb.TokenizeRequest(messages=messages, add_special_tokens=True))
            assert list(out.token_ids) == [0, *bos_tok.encode(rendered, add_special_tokens=False)]
    run(body())


# ---------------------------------------------------------------------------- internal errors


@pytest.mark.parametrize("rpc", ["Detokenize", "GenerateStream"])
def test_unexpected_error_is_internal_without_details(run, monkeypatch, rpc):
    def broken(*args, **kwargs):
        raise RuntimeError("secret detail")

    async def body():
        async with harness() as h:
            calls = {"Detokenize": lambda: h.stub.Detokenize(pb.DetokenizeRequest(token_ids=REPLY_IDS)),
                     "GenerateStream": lambda: h.stream(prompt="Say hello")}
            monkeypatch.setattr(TOK, "decode", broken)
            details = await expect_error(calls[rpc](), grpc.StatusCode.INTERNAL)
            assert "secret detail" not in details and "Traceback" not in details
            assert details == f"{rpc} failed inside the gateway; see its log"
            monkeypatch.undo()
            out = await calls[rpc]()
            assert (out.text if rpc == "Detokenize" else text_of(out)) == REPLY
    run(body())


def test_only_an_answer_read_at_its_end_asks_the_scheduler_for_its_tokens_with_the_finish(run):
    """AddRequest.final_only: unary Generate without stop strings, logprobs or beams; a stream,
    a stop string or logprobs keep the tokens coming step by step."""
    async def body():
        async with harness() as h:
            greedy = pb.SamplingParams(temperature=0)
            await h.stub.Generate(pb.GenerateRequest(prompt="x", sampling=greedy))
            await h.stream(prompt="x", sampling=greedy)
            await h.stub.Generate(pb.GenerateRequest(prompt="x", sampling=greedy,
                                                     stopping=pb.StoppingCriteria(stop=["zz"])))
            await h.stub.Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(logprobs=1)))
            assert [a.final_only for a in h.scheduler.adds] == [True, False, False, False]
    run(body())
