"""The whole system over real gRPC: launcher, scheduler, worker and gateway processes on loopback
with the real SmolLM2 model."""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import wait_for

pytestmark = pytest.mark.integration
GRPCURL = str(Path(sys.executable).parent / "grpcurl")

# Eight: each run alone costs a whole generation of its own.
PROMPTS = [
    "What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
    "What is 2 + 2?", "Who wrote Hamlet?", "Give me a synonym for happy.",
    "Translate 'good morning' to Spanish.", "How many legs does a spider have?",
]


def chat(content: str, max_tokens: int = 24, **stopping) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=content)],
        sampling=pb.SamplingParams(temperature=0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, **stopping))


def collect(stream) -> tuple[list[int], str, int, pb.Usage]:
    ids, text, finish, usage = [], "", 0, None
    for msg in stream:
        ids += list(msg.token_ids)
        text += msg.text
        if msg.finish_reason:
            finish, usage = msg.finish_reason, msg.usage
    return ids, text, finish, usage


def test_grpcurl_streams_an_answer_naming_paris(cluster):
    body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "sampling": {"temperature": 0}, "stopping": {"max_tokens": 32}})
    out = subprocess.run([GRPCURL, "-plaintext", "-d", body, cluster.target,
                          "pagoda.v1.Generation/GenerateStream"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    messages = [json.loads(m) for m in out.stdout.replace("}\n{", "}\x00{").split("\x00") if m.strip()]
    assert len(messages) > 1  # streamed, not one blob
    text = "".join(m.get("text", "") for m in messages)
    assert "Paris" in text
    last = messages[-1]  # grpcurl 1.8 prints proto field names; newer ones print camelCase
    # "The capital of France is Paris." and the end-of-turn token, well before 32 tokens.
    assert last.get("finish_reason", last.get("finishReason")) == "FINISH_REASON_STOP"
    assert int(last.get("matched_token_id", last.get("matchedTokenId", -1))) == 2  # <|im_end|>
    usage = last["usage"]
    assert int(usage.get("prompt_tokens", usage.get("promptTokens", 0))) > 0


def test_grpcurl_list_and_describe(cluster):
    listed = subprocess.run([GRPCURL, "-plaintext", cluster.target, "list"],
                            capture_output=True, text=True, timeout=60)
    assert "pagoda.v1.Generation" in listed.stdout and "grpc.health.v1.Health" in listed.stdout
    described = subprocess.run([GRPCURL, "-plaintext", cluster.target, "describe",
                                "pagoda.v1.GenerateRequest"], capture_output=True, text=True, timeout=60)
    assert "prompt_token_ids" in described.stdout


def test_concurrent_streams_equal_each_run_alone(stub):
    alone = [stub.Generate(chat(p), timeout=120) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: collect(stub.GenerateStream(chat(p), timeout=300)), PROMPTS))
    for p, a, (ids, text, finish, usage) in zip(PROMPTS, alone, together):
        assert ids == list(a.token_ids), p
        # The run alone says where it ends: at the end-of-turn token, or at max_tokens without it.
        assert finish == (pb.FINISH_REASON_STOP if ids[-1] == 2 else pb.FINISH_REASON_LENGTH), p
        assert finish == a.finish_reason
        assert usage.completion_tokens == len(ids)


def test_unary_matches_stream_and_reports_usage(stub):
    req = chat("Who wrote Hamlet?", max_tokens=16)
    unary = stub.Generate(req, timeout=120)
    ids, text, finish, usage = collect(stub.GenerateStream(req, timeout=120))
    assert list(unary.token_ids) == ids and unary.text == text
    tokenized = stub.Tokenize(pb.TokenizeRequest(messages=req.messages), timeout=30)
    assert unary.usage.prompt_tokens == len(tokenized.token_ids)
    # The second identical request finds the prompt's full blocks in the prefix cache.
    assert usage.cached_prompt_tokens >= (len(tokenized.token_ids) - 1) // 16 * 16


def test_cancelled_stream_frees_its_blocks(cluster, stub):
    assert wait_for(lambda: cluster.metric("pagoda_num_requests_running") == 0)
    req = chat("Tell me a very long story about dragons.", max_tokens=200, ignore_eos=True)
    stream = stub.GenerateStream(req, timeout=120)
    got = 0
    for msg in stream:
        got += len(msg.token_ids)
        if got >= 5:
            break
    assert cluster.metric("pagoda_kv_blocks_free") < cluster.metric("pagoda_kv_blocks_total")
    stream.cancel()
    assert wait_for(lambda: cluster.metric("pagoda_num_requests_running") == 0
                    and cluster.metric("pagoda_kv_blocks_free") == cluster.metric("pagoda_kv_blocks_total"))


BAD = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x " * 9000}, "max_model_len"),
    ({"prompt_token_ids": [1, 2, 10 ** 6]}, "prompt_token_ids"),
    ({"prompt": "hi", "stopping": {"max_tokens": -3}}, "max_tokens"),
    ({"prompt": "hi", "stopping": {"max_tokens": 10 ** 9}}, "max_tokens"),
    ({"prompt": "hi", "sampling": {"temperature": float("nan")}}, "temperature"),
    ({"prompt": "hi", "sampling": {"top_p": 0.0}}, "top_p"),
    ({"prompt": "hi", "sampling": {"top_p": 1.5}}, "top_p"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
]


@pytest.mark.parametrize("fields,named", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_input_is_invalid_argument_naming_the_field(cluster, stub, fields, named):
    req = pb.GenerateRequest()
    for key, value in fields.items():
        if key == "prompt":
            req.prompt = value
        elif key == "prompt_token_ids":
            req.prompt_token_ids.extend(value)
        elif key == "messages":
            req.messages.extend(pb.ChatMessage(**m) for m in value)
        else:
            getattr(req, key).MergeFrom(type(getattr(req, key))(**value))
    for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            call(req, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert named in err.value.details()
    with grpc.insecure_channel(cluster.target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
