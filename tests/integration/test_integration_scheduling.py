"""Scheduler behaviour with the real model over real gRPC: preemption in both modes against the
undisturbed output, prefix caching, parallel sampling and the limits."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import Cluster

pytestmark = pytest.mark.integration

QUESTIONS = ["Describe the moon.", "Explain gravity.", "Write about autumn leaves.",
             "What is a volcano?", "Describe a busy market.", "Why do birds sing?"]


def greedy(content: str, max_tokens: int = 40) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=content)],
                              sampling=pb.SamplingParams(temperature=0),
                              stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))


def run_cluster(tmp_path_factory, name, *flags):
    log = tmp_path_factory.mktemp(name) / "cluster.log"
    return Cluster("--dtype", "float32", *flags, log_path=log).start()


@pytest.fixture(scope="module", params=["recompute", "swap"])
def tiny(request, tmp_path_factory):
    # 24 blocks of 16 hold about four of these requests at once, not six: preemption is certain.
    flags = ["--num-gpu-blocks-override", "24", "--max-num-seqs", "8", "--max-model-len", "1024"]
    if request.param == "swap":
        flags += ["--swap-space", "0.05"]
    c = run_cluster(tmp_path_factory, request.param, *flags)
    c.mode = request.param
    yield c
    c.stop()


def answers(stub) -> list[list[int]]:
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return list(pool.map(lambda q: list(stub.Generate(greedy(q), timeout=600).token_ids), QUESTIONS))


@pytest.fixture(scope="module")
def undisturbed(stub):
    """The session cluster's answers: its pool holds all six at once, so nothing is preempted."""
    return answers(stub)


def test_preempted_outputs_equal_the_undisturbed_run(tiny, undisturbed):
    with grpc.insecure_channel(tiny.target) as ch:
        before = tiny.metric("pagoda_num_preemptions_total")
        together = answers(pagoda_pb2_grpc.GenerationStub(ch))
    metrics = tiny.scheduler_metrics()
    by_mode = {k: v for k, v in metrics.items() if k.startswith("pagoda_num_preemptions_total")}
    assert tiny.metric("pagoda_num_preemptions_total") > before, by_mode
    assert any(f'mode="{tiny.mode}"' in k and v > 0 for k, v in by_mode.items()), by_mode
    assert together == undisturbed
    assert tiny.metric("pagoda_kv_blocks_free") == tiny.metric("pagoda_kv_blocks_total")


@pytest.fixture(scope="module")
def roomy(tmp_path_factory):
    c = run_cluster(tmp_path_factory, "roomy", "--num-gpu-blocks-override", "512",
                    "--max-waiting-requests", "4")
    yield c
    c.stop()


def test_shared_system_prompt_is_computed_once(roomy):
    system = " ".join(f"Rule {i}: be kind, precise and brief." for i in range(1, 25))
    with grpc.insecure_channel(roomy.target) as ch:
        stub = pagoda_pb2_grpc.GenerationStub(ch)
        n_system = len(stub.Tokenize(pb.TokenizeRequest(prompt=system)).token_ids)
        assert n_system >= 200
        first = stub.Generate(pb.GenerateRequest(
            messages=[pb.ChatMessage(role="system", content=system),
                      pb.ChatMessage(role="user", content="Hi!")],
            sampling=pb.SamplingParams(temperature=0), stopping=pb.StoppingCriteria(max_tokens=4)))
        second = stub.Generate(pb.GenerateRequest(
            messages=[pb.ChatMessage(role="system", content=system),
                      pb.ChatMessage(role="user", content="What is your name?")],
            sampling=pb.SamplingParams(temperature=0), stopping=pb.StoppingCriteria(max_tokens=4)))
    assert first.usage.cached_prompt_tokens < 16
    assert second.usage.cached_prompt_tokens >= 192
    assert roomy.metric("pagoda_prefix_cache_hits_total") >= 192


def test_parallel_sampling_is_seeded_and_reproducible(roomy):
    req = pb.GenerateRequest(prompt="Once upon a time",
                             sampling=pb.SamplingParams(temperature=1.0, seed=1234, n=3),
                             stopping=pb.StoppingCriteria(max_tokens=12, ignore_eos=True))
    with grpc.insecure_channel(roomy.target) as ch:
        stub = pagoda_pb2_grpc.GenerationStub(ch)
        runs = []
        for _ in range(2):
            out = {0: [], 1: [], 2: []}
            for msg in stub.GenerateStream(req, timeout=300):
                out[msg.index] += list(msg.token_ids)
            runs.append(out)
    assert runs[0] == runs[1]
    assert all(len(v) == 12 for v in runs[0].values())
    assert len({tuple(v) for v in runs[0].values()}) == 3  # distinct draws, shared prompt


def test_request_that_can_never_fit_is_rejected_at_once(roomy):
    with grpc.insecure_channel(roomy.target) as ch:
        stub = pagoda_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.GenerateStream(pb.GenerateRequest(
                prompt="Hello", sampling=pb.SamplingParams(n=4),
                stopping=pb.StoppingCriteria(max_tokens=4000)), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "KV blocks" in err.value.details()


def test_waiting_queue_bound_gives_resource_exhausted(roomy):
    req = pb.GenerateRequest(prompt="Count to one hundred.", sampling=pb.SamplingParams(temperature=0),
                             stopping=pb.StoppingCriteria(max_tokens=64, ignore_eos=True))
    with grpc.insecure_channel(roomy.target) as ch:
        stub = pagoda_pb2_grpc.GenerationStub(ch)
        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(lambda: stub.Generate(req, timeout=600)) for _ in range(12)]
            codes = []
            for f in futures:
                try:
                    f.result()
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    codes.append(e.code())
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert grpc.StatusCode.OK in codes
