"""The RPCs beside Generate over the real stack, the README's grpcurl lines run as written, and
malformed requests refused while a healthy stream runs undisturbed."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.bad_requests import BAD_REQUESTS, build, case_id
from tests.cluster import wait_for

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
GRPCURL = str(Path(sys.executable).parent / "grpcurl")


def long_request(request_id: str = "", max_tokens: int = 300) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id, messages=[pb.ChatMessage(role="user", content="Tell me a long story.")],
        sampling=pb.SamplingParams(temperature=0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))


def test_abort_by_request_id_from_another_connection(cluster, stub):
    stream = stub.GenerateStream(long_request("story-1"), timeout=300)
    first = next(stream)
    assert first.request_id == "story-1"
    with pytest.raises(grpc.RpcError) as dup:  # ids are unique while in flight
        stub.Generate(long_request("story-1", 4), timeout=60)
    assert dup.value.code() == grpc.StatusCode.ALREADY_EXISTS and "story-1" in dup.value.details()
    with grpc.insecure_channel(cluster.target) as other:
        answer = pagoda_pb2_grpc.GenerationStub(other).Abort(
            pb.AbortRequest(request_ids=["story-1", "nobody"]), timeout=30)
    assert list(answer.request_ids) == ["story-1"]
    rest = list(stream)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    streamed = len(first.token_ids) + sum(len(m.token_ids) for m in rest)
    assert streamed < 300 and rest[-1].usage.completion_tokens == streamed
    assert wait_for(lambda: cluster.metric("pagoda_kv_blocks_free") == cluster.metric("pagoda_kv_blocks_total"))
    # The id is free again once its request ended.
    assert stub.Generate(long_request("story-1", 3), timeout=120).finish_reason == pb.FINISH_REASON_LENGTH


def test_get_loads_sees_a_running_request(cluster, stub):
    idle = stub.GetLoads(pb.GetLoadsRequest(), timeout=30)
    (worker,) = idle.workers
    assert worker.kv_blocks_total == 256 and worker.running == 0 and idle.num_pending == 0
    stream = stub.GenerateStream(long_request(max_tokens=200), timeout=300)
    next(stream)
    busy = stub.GetLoads(pb.GetLoadsRequest(), timeout=30).workers[0]
    assert busy.running == 1 and busy.kv_blocks_used >= 2  # a ~40-token chat prompt: 3 blocks
    assert 0.0 <= busy.prefix_cache_hit_rate <= 1.0
    stream.cancel()


def test_detokenize_inverts_tokenize(stub):
    text = "Héllo wörld 😀, naïve café!"
    ids = list(stub.Tokenize(pb.TokenizeRequest(prompt=text), timeout=30).token_ids)
    assert stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=30).text == text
    with_eos = stub.Detokenize(pb.DetokenizeRequest(token_ids=ids + [2]), timeout=30).text
    shown = stub.Detokenize(pb.DetokenizeRequest(token_ids=ids + [2], skip_special_tokens=False), timeout=30)
    assert with_eos == text and shown.text == text + "<|im_end|>"


def readme_grpcurl_lines() -> list[str]:
    lines = [ln.strip() for ln in (ROOT / "README.md").read_text().splitlines()]
    # The plaintext ones: the TLS example needs its certificate (tests/faults/test_security.py covers TLS).
    return [ln for ln in lines if ln.startswith(".venv/bin/grpcurl -plaintext ")]


def test_readme_has_grpcurl_examples():
    assert len(readme_grpcurl_lines()) >= 8


@pytest.mark.parametrize("line", readme_grpcurl_lines())
def test_readme_grpcurl_example_runs_as_written(cluster, line):
    # Only the comment, the binary's path and the address change: the README's default port
    # is the cluster's free one here.
    argv = shlex.split(line, comments=True)
    argv = [GRPCURL if a == ".venv/bin/grpcurl" else a.replace("127.0.0.1:50051", cluster.target)
            for a in argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    if "GenerateStream" in line:
        last = json.loads("{" + out.stdout.rsplit("\n{", 1)[-1])
        assert {"finish_reason", "usage", "seed", "metrics"} <= last.keys()


def test_malformed_requests_are_refused_while_a_healthy_stream_runs(stub):
    assert len(BAD_REQUESTS) >= 40
    healthy = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="Describe the moon.")],
                                 sampling=pb.SamplingParams(temperature=0),
                                 stopping=pb.StoppingCriteria(max_tokens=120, ignore_eos=True))
    alone = stub.Generate(healthy, timeout=300)
    streamed: list[int] = []

    def run_healthy():
        for msg in stub.GenerateStream(healthy, timeout=300):
            streamed.extend(msg.token_ids)

    thread = threading.Thread(target=run_healthy)
    thread.start()
    assert wait_for(lambda: streamed, timeout=120)  # the refusals land while it decodes
    failures = []
    for i, case in enumerate(BAD_REQUESTS):
        request = build(case)
        for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
            try:
                call(request, timeout=60)
                failures.append(f"{case_id(i, case)}: accepted")
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.INVALID_ARGUMENT or case[1] not in e.details():
                    failures.append(f"{case_id(i, case)}: {e.code()} {e.details()!r}")
    assert not failures
    thread.join(300)
    assert streamed == list(alone.token_ids) and len(streamed) == 120
