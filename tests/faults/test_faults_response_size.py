"""The gateway's gRPC send limit is the largest valid response, computed from its flags, the
tokenizer's vocabulary and max_model_len (gateway/bounds/grpc_bounds.py): the largest responses built for
real with the real tokenizer fit it, and a real gateway with that limit delivers the largest unary
Generate (max_model_len tokens of the longest token, logprobs and prompt logprobs at
--max-logprobs) to a real client."""
from __future__ import annotations

import contextlib
import dataclasses

import grpc
import pytest

from gateway.app import Gateway
from gateway.scheduler_link.scheduler_client import SchedulerClient
from gateway.bounds.grpc_bounds import (CONTEXT_BOUND, largest_generate_response, largest_response,
                                        largest_tokenize_response, token_sizes)
from gateway.tokenizer import load_tokenizer
from gateway.validation.limits import Limits
from proto import internal_pb2 as ipb, pagoda_pb2 as pb, pagoda_pb2_grpc
from proto.sizes import LOGPROBS_POSITIONS
from tests.fake_scheduler import FakeScheduler, logprobs_msg, out, until, workers_of

TOK = load_tokenizer("")
SIZES = token_sizes(TOK)
LIMITS = Limits(max_model_len=0, vocab_size=0)  # the default flags
K = LIMITS.max_logprobs
BY_BYTES = sorted(range(TOK.vocab_size), key=lambda i: -len(TOK.token_bytes(i)))
LONGEST = BY_BYTES[0]                            # 81 bytes in SmolLM2's vocabulary
TOP = sorted(range(TOK.vocab_size), key=lambda i: -len(TOK.token_text(i).encode()))[:K]
WIDE = "\U0010ffff"  # 4 UTF-8 bytes, 4 tokens: one token per byte, the most Tokenize returns
LONG_RUN = "="  # runs of it make long tokens: the longest text in the fewest tokens


def scored(first: int, ids: list[int], prompt: bool, request_id: str) -> ipb.Logprobs:
    """Logprobs for positions first.. at k = --max-logprobs, the longest texts as alternatives."""
    n = len(ids)
    return logprobs_msg(request_id, first, ids, [-0.5] * n, [TOK.vocab_size] * n, TOP * n,
                        [-1.0] * (n * K), k=K, prompt=prompt)


def largest_generate_plan(add: ipb.AddRequest) -> list:
    """Prompt logprobs for positions 1..P-1, then max_tokens of the longest token, each scored,
    cut as the scheduler cuts them (LOGPROBS_POSITIONS per Logprobs entry)."""
    p, steps, rid = len(add.prompt_token_ids), [], add.request_id
    for lo in range(1, p, LOGPROBS_POSITIONS):
        steps.append(scored(lo, add.prompt_token_ids[lo:lo + LOGPROBS_POSITIONS], True, rid))
    for lo in range(0, add.max_tokens, LOGPROBS_POSITIONS):
        ids = [LONGEST] * min(LOGPROBS_POSITIONS, add.max_tokens - lo)
        last = lo + len(ids) == add.max_tokens
        steps += [scored(p + lo, ids, False, rid), out(
            request_id=rid, token_ids=ids, finish=ipb.LENGTH if last else ipb.NOT_FINISHED,
            prompt_tokens=p if last else 0)]
    return steps


@contextlib.asynccontextmanager
async def served(max_model_len: int, send_limit: int, plan=None, limits: Limits = LIMITS):
    """A real gateway with the send limit main.py would compute, on a fake scheduler of
    max_model_len; yields a stub whose channel takes messages up to that limit."""
    scheduler = FakeScheduler(TOK, max_model_len=max_model_len)
    if plan is not None:
        scheduler.plan = plan
    client = SchedulerClient(scheduler.address, max_unread=1 << 16)  # the plan sends at once
    gateway = Gateway(TOK, scheduler.address, port=0, client=client, limits=limits,
                      max_response_bytes=send_limit)
    port = await gateway.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
        ("grpc.max_receive_message_length", send_limit)])
    try:
        await until(lambda: workers_of(client) >= 1)
        yield pagoda_pb2_grpc.GenerationStub(channel)
    finally:
        await channel.close()
        await gateway.stop(0.5)
        await scheduler.close()


def test_the_largest_tokenize_and_detokenize_answers_fit(run):
    max_model_len = 256
    limits = Limits(max_model_len=max_model_len, vocab_size=TOK.vocab_size)
    bound = largest_response(LIMITS, SIZES, max_model_len)
    tokenize_bound = largest_tokenize_response(LIMITS, SIZES, max_model_len)

    async def body():
        async with served(max_model_len, bound) as stub:
            return (await stub.Tokenize(pb.TokenizeRequest(prompt=WIDE * (limits.max_tokenize_tokens // 4))),
                    await stub.Tokenize(pb.TokenizeRequest(prompt=LONG_RUN * limits.max_prompt_chars)),
                    await stub.Detokenize(pb.DetokenizeRequest(token_ids=[LONGEST] * max_model_len,
                                                               skip_special_tokens=False)))

    wide, long_text, detokenize = run(body())
    print(f"\nmax_model_len {max_model_len}: Tokenize of {len(wide.token_ids)} tokens "
          f"{wide.ByteSize()} bytes, of {len(long_text.prompt)} characters {long_text.ByteSize()} "
          f"bytes (bound {tokenize_bound}); Detokenize {detokenize.ByteSize()} bytes; send limit {bound}")
    # The most tokens an answer holds (--max-tokenize-contexts), one per byte of WIDE ...
    assert len(wide.token_ids) == limits.max_tokenize_tokens
    # ... and the longest text the context allows, in few tokens: the bound covers both, and
    # the token bound takes effect in it (counted from the characters alone it was 6 times higher).
    assert long_text.prompt == LONG_RUN * limits.max_prompt_chars
    assert max(wide.ByteSize(), long_text.ByteSize()) <= tokenize_bound
    by_characters = largest_tokenize_response(dataclasses.replace(LIMITS, max_tokenize_contexts=1 << 20),
                                              SIZES, max_model_len)
    assert 2 * tokenize_bound < by_characters
    assert detokenize.text == TOK.token_text(LONGEST) * max_model_len
    assert detokenize.ByteSize() <= bound


def test_a_real_gateway_delivers_the_largest_generate_response(run):
    max_model_len, prompt_len = 8192, 4096  # the scheduler's default; half prompt, half output
    limits = Limits(max_model_len=max_model_len, vocab_size=TOK.vocab_size)
    bound = largest_response(LIMITS, SIZES, max_model_len)
    generate_bound = largest_generate_response(LIMITS, SIZES, max_model_len)
    default = largest_response(LIMITS, SIZES)
    request = pb.GenerateRequest(
        request_id="r" * LIMITS.max_request_id_bytes, prompt_token_ids=[LONGEST] * prompt_len,
        return_prompt_token_ids=True, sampling=pb.SamplingParams(logprobs=K, prompt_logprobs=K),
        stopping=pb.StoppingCriteria(max_tokens=max_model_len - prompt_len))

    async def body():
        # The send limit is the point here, not the whole-answer memory budget (24 MiB by
        # default, which this answer passes: test_hostile_bounds.py shows that refusal).
        roomy = dataclasses.replace(LIMITS, max_whole_answer_bytes=1 << 30, max_whole_answers_bytes=1 << 30)
        async with served(max_model_len, bound, largest_generate_plan, roomy) as stub:
            return await stub.Generate(request, timeout=60)

    out = run(body())
    size = out.ByteSize()
    print(f"\nlargest unary Generate at max_model_len {max_model_len}, logprobs {K}: "
          f"{size / 2**20:.2f} MiB delivered; Generate bound {generate_bound / 2**20:.2f} MiB; "
          f"send limit {bound / 2**20:.2f} MiB (Tokenize's bound is larger); before max_model_len "
          f"is known (context bound {CONTEXT_BOUND}): {default / 2**20:.1f} MiB")
    output = max_model_len - prompt_len
    assert list(out.token_ids) == [LONGEST] * output
    assert out.text == TOK.token_text(LONGEST) * output
    assert len(out.logprobs) == output and len(out.prompt_logprobs) == prompt_len - 1
    assert all([t.token_id for t in lp.top_logprobs] == TOP for lp in out.logprobs)
    assert list(out.prompt_token_ids) == request.prompt_token_ids
    assert size <= generate_bound <= bound < 64 << 20
    # Slack: alternatives counted at the longest text each, ids at 5 bytes, text at 3 per byte.
    assert generate_bound < 1.5 * size
    assert largest_response(limits, SIZES, max_model_len) == bound


def test_detokenize_refuses_more_ids_than_max_model_len(run):
    async def body():
        async with served(64, largest_response(LIMITS, SIZES, 64)) as stub:
            ok = await stub.Detokenize(pb.DetokenizeRequest(token_ids=[LONGEST] * 64))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Detokenize(pb.DetokenizeRequest(token_ids=[LONGEST] * 65))
            return ok, e.value

    ok, error = run(body())
    assert ok.text == TOK.token_text(LONGEST) * 64
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "token_ids has 65 ids, more than max_model_len 64"
