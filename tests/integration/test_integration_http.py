"""The OpenAI-compatible HTTP API on the real stack (real processes, the real model): the real
`openai` client, sync and async, whole and streamed, n > 1 and logprobs, and curl. Every answer
is compared with the gRPC answer to the same greedy request, which the other integration tests
hold to transformers."""
from __future__ import annotations

import asyncio
import json
import subprocess

import openai
import pytest

from proto import pagoda_pb2 as pb
from tests.cluster import wait_for

pytestmark = pytest.mark.integration

QUESTION = "What is the capital of France?"
PROMPT = "The three primary colors are"


def grpc_answer(stub, **kw) -> tuple[str, list[int], str, list[pb.TokenLogprob]]:
    """(text, token ids, finish, logprobs) of index 0 of a greedy gRPC stream."""
    responses = list(stub.GenerateStream(pb.GenerateRequest(
        sampling=pb.SamplingParams(temperature=0, **kw.pop("sampling", {})), **kw), timeout=300))
    mine = [r for r in responses if r.index == 0]
    finish = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}[mine[-1].finish_reason]
    return ("".join(r.text for r in mine), [t for r in mine for t in r.token_ids], finish,
            [lp for r in mine for lp in r.logprobs])


def test_chat_equals_grpc_sync_and_async(cluster, stub):
    model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).model
    text, ids, finish, _ = grpc_answer(stub, messages=[pb.ChatMessage(role="user", content=QUESTION)],
                                       stopping=pb.StoppingCriteria(max_tokens=64))
    assert finish == "stop"  # it ends at EOS, as transformers does (test_integration_api)

    sync = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)
    whole = sync.chat.completions.create(model=model, temperature=0, max_tokens=64,
                                         messages=[{"role": "user", "content": QUESTION}])
    assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == (text, finish)
    assert whole.usage.completion_tokens == len(ids)

    async def streamed() -> tuple[str, str | None]:
        client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)
        out, last = "", None
        async for chunk in await client.chat.completions.create(
                model=model, temperature=0, max_completion_tokens=64, stream=True,
                messages=[{"role": "user", "content": QUESTION}]):
            out += chunk.choices[0].delta.content or ""
            last = chunk.choices[0].finish_reason or last
        return out, last
    assert asyncio.run(streamed()) == (text, finish)
    print(f"chat over HTTP = gRPC: {text!r} ({len(ids)} tokens, {finish})")


def test_completions_n_and_logprobs_equal_grpc(cluster, stub):
    model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).model
    text, ids, finish, lps = grpc_answer(stub, prompt=PROMPT, sampling={"logprobs": 2},
                                         stopping=pb.StoppingCriteria(max_tokens=12))
    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)
    out = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=12,
                                    n=2, logprobs=2)
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [(0, text, finish), (1, text, finish)]
    for c in out.choices:
        assert c.logprobs.tokens == [lp.text for lp in lps]
        assert c.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in lps], abs=1e-5)
        assert [list(t) for t in c.logprobs.top_logprobs] == [[t.text for t in lp.top_logprobs] for lp in lps]
    assert out.usage.completion_tokens == 2 * len(ids)


def test_a_negative_seed_samples_as_vllms_int64_does_through_the_uint64_field(cluster, stub):
    """seed -5 (vLLM's int64) samples what gRPC's uint64 seed 2**64 - 5 samples."""
    model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).model
    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)
    texts = [client.completions.create(model=model, prompt=PROMPT, temperature=1.0, max_tokens=12, seed=seed)
             .choices[0].text for seed in (-5, 2**64 - 5)]
    grpc = list(stub.GenerateStream(pb.GenerateRequest(
        prompt=PROMPT, sampling=pb.SamplingParams(temperature=1.0, seed=2**64 - 5),
        stopping=pb.StoppingCriteria(max_tokens=12)), timeout=300))
    assert texts == ["".join(r.text for r in grpc)] * 2


def test_curl_streams_what_grpc_streams(cluster, stub):
    model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).model
    text, _, finish, _ = grpc_answer(stub, prompt=PROMPT, stopping=pb.StoppingCriteria(max_tokens=20))
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 20, "temperature": 0,
                       "stream": True})
    got = subprocess.run(["curl", "-sSN", f"{cluster.base_url}/completions", "-H",
                          "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    events = [e[len("data: "):] for e in got.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == finish


def test_hanging_up_frees_the_blocks(cluster, stub):
    model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).model

    def used() -> int:
        return sum(w.kv_blocks_used for w in stub.GetLoads(pb.GetLoadsRequest(), timeout=30).workers)

    idle = used()
    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # running now
    assert used() > idle
    stream.close()
    assert wait_for(lambda: used() == idle, timeout=30), used()
