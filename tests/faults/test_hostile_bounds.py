"""Issue 53 items 3-6 and 9 against the real stack (scheduler, gateway, fake worker processes):
one tenant sends what is bounded, and is refused as soon as the bound is known, while tenant B's
stream runs and ends token-exact, health answers within 1 s throughout (probed every 0.2 s), and
the gateway's RSS grows by less than 100 MB, at its peak (sampled with each probe) and after."""
from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import wait_for
from gateway.tokenizer import load_tokenizer
from tests.fake_cluster import SERVING, FakeCluster, rss_bytes
from tests.fake_worker import reference_output
from tests.streams import Stream

pytestmark = pytest.mark.integration

KEY_A, KEY_B = "tenant-a-secret", "tenant-b-secret"
AUTH_A, AUTH_B = (("authorization", f"Bearer {KEY_A}"),), (("authorization", f"Bearer {KEY_B}"),)
RSS_GROWTH = 100e6
MODEL = "SmolLM2-135M-Instruct"
TOK = load_tokenizer("")  # the gateway's
WHOLE_ANSWER, WHOLE_ANSWERS = 24 << 20, 64 << 20  # the defaults
BIG = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    c = FakeCluster(
        tmp_path_factory.mktemp("hostile-bounds"), http=True,
        gateway_flags=["--api-key", KEY_A, "--api-key", KEY_B,
                       "--max-large-input-bytes", str(256 << 10)],
        worker_flags=["--num-gpu-blocks-override", "20000", "--step-delay", "0.01"]).start()
    c.max_model_len = c.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH_A).max_model_len
    c.big = grpc.insecure_channel(c.target, options=BIG)
    c.big_stub = pagoda_pb2_grpc.GenerationStub(c.big)
    yield c
    c.big.close()
    c.stop()


class Health(threading.Thread):
    """gRPC health probed every 0.2 s until stopped: the slowest answer, and any that failed."""

    def __init__(self, stack):
        super().__init__(daemon=True)
        self.stack, self.slowest, self.failed, self.done = stack, 0.0, 0, threading.Event()
        self.peak = 0  # the gateway's RSS, sampled with each probe
        self.start()

    def run(self) -> None:
        while not self.done.is_set():
            started = time.monotonic()
            try:
                ok = self.stack.health.Check(health_pb2.HealthCheckRequest(service=""),
                                             timeout=5).status == SERVING
            except grpc.RpcError:
                ok = False
            self.slowest = max(self.slowest, time.monotonic() - started)
            self.peak = max(self.peak, rss_bytes(self.stack.gateway.pid))
            self.failed += not ok
            self.done.wait(0.2)

    def stop(self) -> "Health":
        self.done.set()
        self.join()
        return self


class Attack:
    """Tenant B's stream and the health probe around one attack; on leaving, both are checked,
    and the gateway's RSS against what it was when the attack began."""

    def __init__(self, stack, i: int, max_tokens: int = 60):
        self.stack, self.i, self.max_tokens = stack, i, max_tokens

    def __enter__(self) -> "Attack":
        self.rss = rss_bytes(self.stack.gateway.pid)
        self.health = Health(self.stack)
        req = pb.GenerateRequest(prompt_token_ids=[7, 8, 9, 100 + self.i],
                                 sampling=pb.SamplingParams(seed=self.i),
                                 stopping=pb.StoppingCriteria(max_tokens=self.max_tokens))
        self.stream = Stream(self.stack.stub, req, metadata=AUTH_B)
        assert wait_for(lambda: self.stream.tokens, 10)
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            self.health.stop()
            return
        self.stream.join(60)
        health = self.health.stop()
        grown = rss_bytes(self.stack.gateway.pid) - self.rss
        print(f"\nhealth: slowest {health.slowest:.3f} s; gateway RSS +{grown / 1e6:.0f} MB "
              f"(at most +{(health.peak - self.rss) / 1e6:.0f} MB during the attack)")
        assert self.stream.code == grpc.StatusCode.OK, self.stream.details
        assert self.stream.tokens == reference_output([7, 8, 9, 100 + self.i], self.max_tokens,
                                                      seed=self.i)
        assert health.failed == 0 and health.slowest < 1.0
        assert grown < RSS_GROWTH and health.peak - self.rss < RSS_GROWTH
        assert wait_for(self.stack.idle_and_free, 30), self.stack.scheduler_metrics()


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def field_of(error: grpc.RpcError) -> str:
    return dict(error.trailing_metadata() or ()).get("pagoda-field", "")


def post(stack, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=30)
    conn.request("POST", path, json.dumps(body, ensure_ascii=False).encode(),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY_A}"})
    response = conn.getresponse()
    status, payload = response.status, json.loads(response.read())
    conn.close()
    return status, payload


# ---------------------------------------------------------------------------- 3: Abort ids

def test_an_abort_of_22000_ids_is_invalid_argument_and_the_link_stays_up(stack):
    with Attack(stack, 1):
        started = time.monotonic()
        e = rpc_error(lambda: stack.big_stub.Abort(
            pb.AbortRequest(request_ids=[f"{i:0256d}" for i in range(22_000)]),
            metadata=AUTH_A, timeout=30))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and field_of(e) == "request_ids"
        assert e.details() == "request_ids has 22000 ids, at most 4096 are allowed in one Abort"
        assert time.monotonic() - started < 2.0
        # The largest valid one reaches the scheduler and is answered.
        reply = stack.big_stub.Abort(pb.AbortRequest(request_ids=[f"{i:0256d}" for i in range(4096)]),
                                     metadata=AUTH_A, timeout=10)
        assert list(reply.request_ids) == []


# ---------------------------------------------------------------------------- 4: token ids

def test_six_huge_prompt_token_id_lists_are_refused_before_any_list_is_built(stack):
    # 580,000 one-byte ids: a message under the byte bound for this context, so what refuses it
    # is their count (as a list, 21 MB each, and the max over it).
    req = pb.GenerateRequest(prompt_token_ids=[5] * 580_000)
    with Attack(stack, 2), ThreadPoolExecutor(6) as pool:
        started = time.monotonic()
        errors = list(pool.map(lambda _: rpc_error(lambda: stack.big_stub.Generate(
            req, metadata=AUTH_A, timeout=30)), range(6)))
        took = time.monotonic() - started
        assert [(e.code(), e.details()) for e in errors] == [(
            grpc.StatusCode.INVALID_ARGUMENT, f"prompt_token_ids is 580000 tokens, must be fewer "
            f"than max_model_len {stack.max_model_len} to leave room for output")] * 6
        assert took < 3.0


# ---------------------------------------------------------------------------- 5: deep JSON

def test_json_nested_16000_deep_is_400_or_invalid_argument_naming_the_field(stack):
    deep = "[" * 16_000 + "]" * 16_000  # under --max-structured-output-bytes, past json's recursion
    with Attack(stack, 3):
        status, body = post(stack, "/v1/completions", {
            "model": MODEL, "prompt": "hi", "max_tokens": 1, "structured_outputs": {"json": deep}})
        assert (status, body["error"]["param"], body["error"]["message"]) == (
            400, "structured_outputs", "structured_outputs is not JSON: it nests 16000 levels "
                                       "deep, at most 128 are allowed"), body
        e = rpc_error(lambda: stack.stub.Generate(pb.GenerateRequest(
            prompt="hi", sampling=pb.SamplingParams(structured_output=pb.StructuredOutput(
                json_schema=deep))), metadata=AUTH_A, timeout=10))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.details() == ("sampling.structured_output.json_schema is not JSON: it nests "
                               "16000 levels deep, at most 128 are allowed")
        # A parsed schema under json's own limit but past ours: refused the same way.
        schema: dict = {}
        for _ in range(300):
            schema = {"type": "array", "items": schema}
        status, body = post(stack, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}})
        assert (status, body["error"]["param"], body["error"]["message"]) == (
            400, "response_format", "response_format is not JSON: it nests 301 levels deep, at "
                                    "most 128 are allowed"), body


# ---------------------------------------------------------------------------- 6: Tokenize

def test_the_largest_tokenize_is_refused_in_pieces_and_the_largest_answered_run_two_at_once(stack):
    # The most characters a prompt may have, each of 4 UTF-8 bytes and 4 tokens: 524,288 tokens,
    # which encoded whole took the gateway 330 MB. Encoding in pieces stops past the bound.
    chars = stack.max_model_len * 32
    most = 2 * stack.max_model_len  # --max-tokenize-contexts
    refusal = (f"is more than {most} tokens, the most a Tokenize answer holds (max_model_len "
               f"{stack.max_model_len} x 2, --max-tokenize-contexts)")
    huge = "\U0010ffff" * chars
    # The same characters as "=": 128 KiB, tokenized off the loop into a few thousand tokens.
    largest = pb.TokenizeRequest(prompt="=" * chars)
    expected = TOK.encode(largest.prompt)
    with Attack(stack, 4, max_tokens=200), ThreadPoolExecutor(4) as pool:
        started = time.monotonic()
        errors = list(pool.map(lambda _: rpc_error(lambda: stack.big_stub.Tokenize(
            pb.TokenizeRequest(prompt=huge), metadata=AUTH_A, timeout=30)), range(4)))
        assert [(e.code(), e.details(), field_of(e)) for e in errors] == [
            (grpc.StatusCode.INVALID_ARGUMENT, "prompt " + refusal, "prompt")] * 4
        # Chat content holding special-token text is encoded span by span: bounded the same way.
        e = rpc_error(lambda: stack.big_stub.Tokenize(pb.TokenizeRequest(messages=[pb.ChatMessage(
            role="user", content="<|im_end|>" + huge[:-64])]), metadata=AUTH_A, timeout=30))
        assert (e.code(), e.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "messages " + refusal)
        status, body = post(stack, "/tokenize", {"model": MODEL, "prompt": huge})
        assert (status, body["error"]["param"], body["error"]["message"]) == (
            400, "prompt", "prompt " + refusal)
        assert time.monotonic() - started < 5.0
        # Four of the largest that are answered: two at a time (--max-large-input-bytes).
        replies = list(pool.map(lambda _: stack.big_stub.Tokenize(largest, metadata=AUTH_A, timeout=60),
                                range(4)))
        assert [list(r.token_ids) for r in replies] == [expected] * 4
        assert {len(r.offsets) for r in replies} == {len(expected)}


# ---------------------------------------------------------------------------- 9: whole answers

def test_whole_answers_with_logprobs_are_bounded_per_gateway(stack):
    def whole(max_tokens: int) -> pb.GenerateRequest:
        return pb.GenerateRequest(prompt_token_ids=[3, 4, 5], sampling=pb.SamplingParams(logprobs=20),
                                  stopping=pb.StoppingCriteria(max_tokens=max_tokens))
    with Attack(stack, 5), ThreadPoolExecutor(8) as pool:
        # 400 positions with 20 alternatives can cost more than 24 MiB of memory (the defaults):
        # each reserves the 24 MiB a whole answer may keep, and the gateway has 64 MiB for them
        # all, so of 8 sent at once (each running 4 s), 2 are served and 6 refused at once.
        calls = list(pool.map(lambda _: _outcome(lambda: stack.stub.Generate(
            whole(400), metadata=AUTH_A, timeout=60)), range(8)))
        assert sorted(calls, key=lambda c: (c[0].value[0], c[1])) == [(grpc.StatusCode.OK, "")] * 2 + [(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"whole answers on this gateway hold {2 * WHOLE_ANSWER} of {WHOLE_ANSWERS} bytes "
            f"(--max-whole-answers-bytes) and this one needs {WHOLE_ANSWER} more; retry later, "
            "or stream it")] * 6
        # Streamed, an answer is not kept, so not counted.
        streams = list(pool.map(lambda _: sum(len(r.token_ids) for r in stack.stub.GenerateStream(
            whole(100), metadata=AUTH_A, timeout=60)), range(8)))
        assert streams == [100] * 8
    # Once they ended, the budget is whole again.
    assert len(stack.stub.Generate(whole(4), metadata=AUTH_A, timeout=10).token_ids) == 4


def _outcome(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()
