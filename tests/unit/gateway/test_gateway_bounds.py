"""Issue 53's bounds at the edge: internal frames derived from the public bounds, JSON depth,
prompt_token_ids counted before they are built, Tokenize off the loop, unary logprobs memory."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

import grpc
import pytest

from gateway import json_nesting
from gateway.generation.answer_budget import IN_MEMORY, AnswerBudget, answer_bytes
from gateway.bounds.client_auth import tenant_of_key
from gateway.gateway_flags import REQUEST_CEILINGS, REQUEST_LIMITS, parse_gateway_args
from gateway.bounds.grpc_bounds import RequestSizeInterceptor, largest_request
from gateway.generation.large_inputs import LargeJobs
from gateway.validation.limits import Limits
from gateway.statuses import RpcFailed
from gateway.validation.structured_check import MAX_CHOICES, StructuredError, structured_spec
from gateway.chat.tool_parsers import parser
from gateway.validation.validate import (MAX_ABORT_IDS, MAX_CACHE_SALT_BYTES, ValidationError,
                                         prompt_ids)
from proto import internal_pb2 as ipb, pagoda_pb2 as pb, pagoda_pb2_grpc
from proto.sizes import largest_gateway_message
from scheduler.message_checks import check_add, check_call
from tests.fake_scheduler import local_gateway, until
from tests.unit.gateway.test_gateway_api import LP_IDS, TOK, expect_error, logprobs_plan

DEEP = "[" * 30_000 + "]" * 30_000


# ---------------------------------------------------------------------------- frames

def largest_abort_call() -> ipb.GatewayMessage:
    """The largest Abort the gateway passes on: MAX_ABORT_IDS ids at the ceiling of
    --max-request-id-bytes, each behind a tenant's prefix, with the largest call id."""
    rid = tenant_of_key("k") + "\U0010ffff" * (REQUEST_CEILINGS["max_request_id_bytes"] // 4)
    return ipb.GatewayMessage(call=ipb.Call(call_id=2**64 - 1, abort=pb.AbortRequest(
        request_ids=[rid] * MAX_ABORT_IDS)))


def test_the_largest_valid_abort_fits_the_schedulers_frame_limit():
    msg = largest_abort_call()
    assert check_call(msg.call) is None  # the scheduler takes it
    # Its frame limit is smallest for the shortest context.
    assert msg.ByteSize() <= largest_gateway_message(1)
    one_more = ipb.Call(abort=pb.AbortRequest(request_ids=[*msg.call.abort.request_ids, "x"]))
    assert check_call(one_more) is not None


@pytest.mark.parametrize("max_model_len", [1, 4096, 131072])
def test_the_largest_valid_add_request_fits_the_schedulers_frame_limit(max_model_len):
    """Every field the gateway lets a client fill, at the ceiling of its flag: a GenerateRequest
    validated into the AddRequest the scheduler receives."""
    ceilings, vocab = REQUEST_CEILINGS, 1 << 31
    tenant = tenant_of_key("k")
    spec = "x" * ceilings["max_structured_output_bytes"]
    add = ipb.AddRequest(
        request_id="g" * 64, prompt_token_ids=[vocab - 1] * max(0, max_model_len - 1),
        sampling=ipb.SamplingConfig(
            temperature=1.5, top_p=0.5, top_k=1 << 20, min_p=0.5, presence_penalty=-2.0,
            frequency_penalty=-2.0, repetition_penalty=1.5, has_seed=True, seed=2**63 - 1,
            logprobs=ceilings["max_logprobs"], prompt_logprobs=ceilings["max_logprobs"],
            min_tokens=max_model_len, logit_bias={vocab - 1 - i: -100.0
                                              for i in range(ceilings["max_logit_bias"])},
            structured_output=pb.StructuredOutput(regex=spec)),
        n=16, max_tokens=max_model_len, stop_token_ids=[vocab - 1] * ceilings["max_stop_token_ids"],
        priority=-1_000_000, public_id=tenant + "\U0010ffff" * (ceilings["max_request_id_bytes"] // 4),
        cache_salt=tenant + "s" * MAX_CACHE_SALT_BYTES, tenant=tenant, final_only=True)
    assert check_add(add, vocab) is None  # the scheduler takes it ...
    # ... and it fits the frame limit the scheduler computes for its context.
    assert ipb.GatewayMessage(add=add).ByteSize() <= largest_gateway_message(max(1, max_model_len))


def test_request_flags_stay_under_what_the_scheduler_takes():
    for dest, default, _, _ in REQUEST_LIMITS:
        assert default <= REQUEST_CEILINGS.get(dest, default), dest
    assert REQUEST_CEILINGS["max_structured_output_bytes"] + 3 * MAX_CHOICES <= 64 << 10
    with pytest.raises(SystemExit):
        parse_gateway_args(["--max-logit-bias", str(REQUEST_CEILINGS["max_logit_bias"] + 1)])
    assert parse_gateway_args(["--max-logit-bias", str(REQUEST_CEILINGS["max_logit_bias"])])


def test_an_abort_past_the_bound_is_refused_before_the_scheduler_hears(run):
    async def body():
        async with local_gateway(TOK) as h:
            details = await expect_error(h.stub.Abort(pb.AbortRequest(
                request_ids=["x"] * (MAX_ABORT_IDS + 1))), grpc.StatusCode.INVALID_ARGUMENT)
            assert details == (f"request_ids has {MAX_ABORT_IDS + 1} ids, at most "
                               f"{MAX_ABORT_IDS} are allowed in one Abort")
            reply = await h.stub.Abort(pb.AbortRequest(request_ids=["x"] * MAX_ABORT_IDS))
            assert list(reply.request_ids) == []
            assert len(h.scheduler.calls) == 1
    run(body())


# ---------------------------------------------------------------------------- JSON depth

@pytest.mark.parametrize("text,depth", [
    ("1", 0), ("[]", 1), ('{"a": [{"b": "[[[["}]}', 3), ('"\\"[["', 0), ('["a\\\\", [1]]', 2),
    ('["\u00e9", [[1]]]', 3), (DEEP, 30_000)])
def test_nesting_depth_counts_brackets_outside_strings(text, depth):
    assert json_nesting.nesting_depth(text) == depth


def test_json_past_the_depth_is_refused_before_parsing():
    ok = "[" * json_nesting.MAX_JSON_DEPTH + "]" * json_nesting.MAX_JSON_DEPTH
    assert json_nesting.loads(ok) is not None
    with pytest.raises(json_nesting.TooDeep, match="nests 129 levels deep, at most 128"):
        json_nesting.loads("[" + ok + "]")


@pytest.mark.parametrize("kind", ["json_schema", "structural_tag"])
def test_a_deep_structured_output_is_invalid_argument_naming_it(kind):
    req = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(
        structured_output=pb.StructuredOutput(**{kind: '{"a":' * 30_000 + "1" + "}" * 30_000})))
    with pytest.raises(StructuredError) as e:
        structured_spec(req, 1 << 20)
    assert e.value.field == f"sampling.structured_output.{kind}"
    assert str(e.value) == (f"sampling.structured_output.{kind} is not JSON: it nests 30000 "
                            "levels deep, at most 128 are allowed")


def test_a_deep_tool_call_from_the_model_is_text():
    p = parser("hermes")  # arguments first: the call is parsed whole, not streamed
    body = '{"arguments": ' + DEEP + ', "name": "f"}'
    out = p.feed("<tool_call>" + body + "</tool_call>") + p.finish()
    assert not p.called
    assert "".join(f.content or "" for f in out) == "<tool_call>" + body + "</tool_call>"


# ---------------------------------------------------------------------------- prompt_token_ids

class _NoList:
    """A repeated field that tells its length and refuses to be read: anything built from it
    would raise."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        raise AssertionError("the ids were read before their count was checked")


class _Request:
    """A GenerateRequest of n prompt_token_ids, as validate reads it."""
    DESCRIPTOR = pb.GenerateRequest.DESCRIPTOR

    def __init__(self, n: int, truncate: int | None = None):
        self.prompt_token_ids, self.prompt, self.messages, self.tools = _NoList(n), "", [], []
        self._truncate = truncate

    def HasField(self, name: str) -> bool:
        return name == "truncate_prompt_tokens" and self._truncate is not None

    @property
    def truncate_prompt_tokens(self) -> int:
        return self._truncate


def test_prompt_token_ids_are_counted_before_any_list_is_built():
    limits = Limits(max_model_len=64, vocab_size=1000)
    with pytest.raises(ValidationError) as e:
        prompt_ids(_Request(6_000_000), TOK, 1000, limits=limits)
    assert e.value.field == "prompt_token_ids"
    assert str(e.value) == ("prompt_token_ids is 6000000 tokens, must be fewer than "
                            "max_model_len 64 to leave room for output")
    # truncate_prompt_tokens lets in as many ids as a prompt's characters, no more.
    with pytest.raises(ValidationError, match=r"^prompt_token_ids has 2049 ids, more than 2048 "):
        prompt_ids(_Request(64 * 32 + 1, truncate=10), TOK, 1000, limits=limits, truncate=10)


def test_detokenize_counts_its_ids_first(run):
    async def body():
        async with local_gateway(TOK) as h:
            n = h.gateway.client.info.max_model_len + 1
            details = await expect_error(h.stub.Detokenize(pb.DetokenizeRequest(
                token_ids=[10**6] * n)), grpc.StatusCode.INVALID_ARGUMENT)
            assert details.startswith(f"token_ids has {n} ids, more than max_model_len")
    run(body())


# ---------------------------------------------------------------------------- before parsing

class _Echo(pagoda_pb2_grpc.GenerationServicer):
    parsed = 0

    async def Generate(self, request, context):
        return pb.GenerateResponse(text=str(len(request.prompt_token_ids)))

    async def GenerateStream(self, request, context):
        for i in range(2):
            yield pb.GenerateResponse(text=str(i))


def test_requests_past_the_contexts_largest_are_refused_before_parsing(run):
    async def body():
        context = [0]
        server = grpc.aio.server(interceptors=[RequestSizeInterceptor(
            Limits(0, 0), lambda: context[0])], options=[
            ("grpc.max_receive_message_length", 64 << 20)])
        pagoda_pb2_grpc.add_GenerationServicer_to_server(_Echo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_send_message_length", 64 << 20)])
        stub = pagoda_pb2_grpc.GenerationStub(channel)
        try:
            big = pb.GenerateRequest(prompt_token_ids=[5] * 6_000_000)
            # Before the context is known, gRPC's own limit applies.
            assert (await stub.Generate(big)).text == "6000000"
            context[0] = 4096
            bound = largest_request("Generate", Limits(0, 0), 4096)
            for rpc in (stub.Generate(big), stub.GenerateStream(big).read()):
                details = await expect_error(rpc, grpc.StatusCode.INVALID_ARGUMENT)
                assert details == (f"prompt_token_ids: the request is {big.ByteSize()} bytes, more "
                                   f"than the largest valid one for max_model_len 4096 ({bound} "
                                   "bytes); refused before parsing")
            # The field named is the one holding most of the request, whatever comes first.
            chat = pb.GenerateRequest(request_id="r", messages=[pb.ChatMessage(content="x" * (4 << 20))],
                                      prompt_token_ids=[5] * 1000)
            details = await expect_error(stub.Generate(chat), grpc.StatusCode.INVALID_ARGUMENT)
            assert details.startswith("messages: the request is ")
            small = pb.GenerateRequest(prompt_token_ids=[5] * 100)
            assert (await stub.Generate(small)).text == "100"
            assert [r.text async for r in stub.GenerateStream(small)] == ["0", "1"]
        finally:
            await channel.close()
            await server.stop(0)
    run(body())


# ---------------------------------------------------------------------------- large inputs

def test_long_texts_encode_as_the_plain_call_does():
    text = "Hello, world! \u00e9\U0010ffff <|im_start|> " * 400
    batch = TOK.encode_with_offsets(text, True)
    plain = TOK.tokenizer.encode(text, add_special_tokens=True)
    assert batch == (plain.ids, [tuple(o) for o in plain.offsets])
    assert TOK.encode(text) == plain.ids
    assert TOK.decode(plain.ids * 2) == TOK.tokenizer.decode(plain.ids * 2)


def test_large_tokenize_calls_run_off_the_loop_at_most_slots_at_once(run):
    async def body():
        async with local_gateway(TOK) as h:
            servicer = h.gateway.servicer
            servicer.large_jobs = LargeJobs(slots=2, wait=30)
            # 32 contexts of 2,048: room for the answer of 65,536 tokens below.
            servicer.base_limits = dataclasses.replace(servicer.base_limits, max_tokenize_contexts=32)
            loop_thread, threads, running, most = threading.get_ident(), set(), [0], [0]
            tokenize = servicer._tokenize

            def spy(request, limits):
                threads.add(threading.get_ident())
                running[0] += 1
                most[0] = max(most[0], running[0])
                try:
                    time.sleep(0.2)  # long enough for the others to start, were they allowed
                    return tokenize(request, limits)
                finally:
                    running[0] -= 1
            servicer._tokenize = spy
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{h.gateway.port}", options=[
                ("grpc.max_receive_message_length", 64 << 20)])
            stub = pagoda_pb2_grpc.GenerationStub(channel)
            # 16,384 characters of U+10FFFF: 64 KiB, 65,536 tokens.
            req = pb.TokenizeRequest(prompt="\U0010ffff" * 16_384)
            replies = await asyncio.gather(*(stub.Tokenize(req) for _ in range(4)))
            expected = TOK.encode_with_offsets(req.prompt, True)
            for r in replies:
                assert list(r.token_ids) == expected[0]
                assert [(o.start, o.end) for o in r.offsets] == expected[1]
                assert list(r.tokens) == [TOK.id_to_token(i) for i in expected[0]]
            assert loop_thread not in threads and most[0] == 2
            # Past the wait, a large call is refused; a small one never waits.
            servicer.large_jobs = LargeJobs(slots=1, wait=0)
            first = asyncio.ensure_future(stub.Tokenize(req))
            await asyncio.sleep(0.1)
            details = await expect_error(stub.Tokenize(req), grpc.StatusCode.RESOURCE_EXHAUSTED)
            size = req.ByteSize()
            assert details == (f"1 large requests of {size} bytes are being tokenized or answered "
                               f"and this one ({size} bytes) waited 0 s for room "
                               "(--max-large-input-jobs, --max-large-input-bytes); retry later")
            assert list((await stub.Tokenize(pb.TokenizeRequest(prompt="hi"))).token_ids)
            assert len((await first).token_ids) == len(expected[0])
            await channel.close()
    run(body())


# ---------------------------------------------------------------------------- whole answers

def refused(message: str) -> Exception:
    return RuntimeError(message)


def test_the_budget_reserves_grows_and_releases():
    budget = AnswerBudget(per_answer=1000, total=1500, refuse=refused, tokenizer=TOK)
    a = budget.hold(5000)  # at most per_answer
    assert (a.held, budget.free) == (1000, 500)
    with pytest.raises(RuntimeError, match=r"^whole answers on this gateway hold 1000 of 1500 "
                                           r"bytes \(--max-whole-answers-bytes\) and this one "
                                           r"needs 600 more"):
        budget.hold(600)
    b = budget.hold(100)
    b.keep(10)  # of wire size: IN_MEMORY times as many bytes of memory
    assert b.kept == 10 * IN_MEMORY == 60
    b.keep(10)  # past its reservation: it takes more while the gateway has it
    assert (b.held, budget.free) == (240, 260)
    with pytest.raises(RuntimeError, match=r"^the answer passed 1000 bytes"):
        a.keep(1000 // IN_MEMORY + 1)
    a.release()
    b.release()
    assert budget.free == 1500


def test_a_whole_answer_reserves_at_least_what_it_keeps(run):
    async def body():
        async with local_gateway(TOK) as h:
            h.scheduler.plan = logprobs_plan
            servicer = h.gateway.servicer
            holds = []
            hold_for = servicer.answers.hold_for
            servicer.answers.hold_for = lambda v: holds.append(hold_for(v)) or holds[-1]
            request = pb.GenerateRequest(prompt="Say hello", sampling=pb.SamplingParams(logprobs=2),
                                         stopping=pb.StoppingCriteria(max_tokens=4))
            one = await h.stub.Generate(request)
            assert list(one.token_ids) == LP_IDS
            assert len(holds) == 1 and 0 < holds[0].kept
            assert holds[0].kept <= IN_MEMORY * answer_bytes(servicer.answers.spelling, 4, 0, 2, None, False)
            assert holds[0].held == 0 and servicer.answers.free == servicer.answers.total
            # A gateway whose budget is spent refuses the next whole answer at once; streams
            # keep nothing and are not counted.
            servicer.answers = AnswerBudget(1 << 20, 100, lambda m: RpcFailed(
                grpc.StatusCode.RESOURCE_EXHAUSTED, m), TOK)
            details = await expect_error(h.stub.Generate(request), grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert details.startswith("whole answers on this gateway hold 0 of 100 bytes")
            assert [r async for r in h.stub.GenerateStream(request)]
            assert h.scheduler.aborts == [] and servicer.answers.free == 100
            # An answer that outgrows what one may keep ends, and is aborted at the scheduler.
            servicer.answers = AnswerBudget(200, 1 << 20, lambda m: RpcFailed(
                grpc.StatusCode.RESOURCE_EXHAUSTED, m), TOK)
            details = await expect_error(h.stub.Generate(request), grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert details == ("the answer passed 200 bytes (--max-whole-answer-bytes); ask for "
                               "it streamed (GenerateStream, or stream: true)")
            await until(lambda: len(h.scheduler.aborts) == 1)
            assert servicer.answers.free == 1 << 20
    run(body())


class _Sized:
    def __init__(self, n: int):
        self.n = n

    def ByteSize(self) -> int:
        return self.n


def test_large_jobs_are_admitted_by_bytes_in_order(run):
    async def body():
        jobs = LargeJobs(slots=4, wait=30, max_bytes=100_000)
        running, most, beside = [0], [0], {}

        def work(name: str) -> str:
            running[0] += 1
            most[0] = max(most[0], running[0])
            beside[name] = running[0]
            time.sleep(0.05)
            running[0] -= 1
            return name
        sizes = {"a": 60_000, "b": 60_000, "c": 30_000, "huge": 10**6, "d": 40_000}
        done = await asyncio.gather(*(jobs.run(_Sized(n), work, name) for name, n in sizes.items()))
        assert done == list(sizes)
        # a runs alone (b does not fit beside it, and c waits behind b); b and c together; then
        # "huge" alone; then d.
        assert (beside["a"], beside["huge"], beside["d"], most[0]) == (1, 1, 1, 2)
        assert (jobs._jobs, jobs._bytes, len(jobs._waiters)) == (0, 0, 0)
        jobs.close()
    run(body())
