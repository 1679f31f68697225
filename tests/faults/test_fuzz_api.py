"""Bad input never gets a 500: the public APIs fuzzed against the real stack (scheduler, gateway,
a fake worker registering the real tokenizer's vocabulary, so that chat prompts run), with a
key. Each HTTP operation of the gateway's OpenAPI document gets schemathesis's requests
(tests/http_fuzz.py), each RPC of pagoda.proto hypothesis-drawn messages (tests/grpc_fuzz.py),
at most 50 examples each and a fixed seed, so the suite runs the same requests every time.
After each: no 5xx, every answer as the document describes it (status, media type, body), no
INTERNAL or UNKNOWN status, every call answered within its deadline, and the gateway alive,
healthy, serving and with every block free. A test stops at its first failure and shows it.
bench/fuzz_api.py runs the same against the real model, with thousands of examples."""
from __future__ import annotations

import http.client
import json

import pytest

from gateway.rest.openapi import OPERATIONS
from tests.cluster import wait_for
from tests.fake_cluster import SERVING, FakeCluster
from tests import grpc_fuzz, http_fuzz
from tests.proto_strategies import Sizes

pytestmark = pytest.mark.integration

KEY = "fuzz-key"
MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152          # the real tokenizer's, so that rendered chat prompts pass the scheduler
MAX_MODEL_LEN = 96     # short answers: a drawn request runs for milliseconds
EXAMPLES = 50
SEED = 53
# Huge fields up to 64 Ki characters or entries here (bench/fuzz_api.py: up to gRPC's 16 MiB).
SIZES = Sizes(huge=1 << 16)
DEADLINE = 5.0  # each call's: on the fake worker every answer takes milliseconds


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    canned = folder / "canned.json"
    canned.write_text("{}")  # no canned answers: the fake model's own tokens, any of VOCAB
    c = FakeCluster(folder, http=True, worker_module="tests.fake_worker_canned",
                    gateway_flags=["--api-key", KEY],
                    worker_flags=["--canned", str(canned), "--vocab-size", str(VOCAB),
                                  "--max-model-len", str(MAX_MODEL_LEN),
                                  "--num-gpu-blocks-override", "4000"]).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def document(stack):
    return http_fuzz.load(f"http://127.0.0.1:{stack.http_port}")


def assert_healthy(stack) -> None:
    assert stack.gateway.poll() is None, stack.log_tail()
    assert stack.health_status() == SERVING
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}),
        {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    response = conn.getresponse()
    answer = json.loads(response.read())
    conn.close()
    assert response.status == 200 and answer["choices"][0]["finish_reason"] == "length", answer
    assert wait_for(stack.idle_and_free, 10), stack.scheduler_metrics()


@pytest.mark.parametrize("path, method", sorted(OPERATIONS))
def test_http_operation_never_fails_inside(stack, document, path, method):
    report = http_fuzz.fuzz(document, path, method, f"http://127.0.0.1:{stack.http_port}", KEY,
                            MODEL, EXAMPLES, SEED, timeout=DEADLINE, max_failures=1)
    assert report.examples >= 1 and not report.failures, "\n\n".join(report.failures[:5])
    assert_healthy(stack)


@pytest.mark.parametrize("rpc", grpc_fuzz.RPCS)
def test_rpc_never_fails_inside(stack, rpc):
    report = grpc_fuzz.fuzz(stack.channel, rpc, KEY, EXAMPLES, SEED, SIZES, vocab_size=VOCAB,
                            max_tokens=MAX_MODEL_LEN // 2, timeout=DEADLINE, max_failures=1)
    assert report.examples >= 1 and not report.failures, "\n\n".join(report.failures[:5])
    assert_healthy(stack)


def test_every_rpc_is_fuzzed():
    """The list comes from the service's descriptor: a new RPC is fuzzed without a line here."""
    assert set(grpc_fuzz.RPCS) == {"Generate", "GenerateStream", "Tokenize", "Detokenize",
                                   "Abort", "GetModelInfo", "GetLoads"}
