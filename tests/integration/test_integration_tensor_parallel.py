"""A real cluster whose worker is SmolLM2 on three tensor-parallel ranks (gloo on the CPU): when
one of its ranks is killed mid-stream the worker leaves with a goodbye and every stream goes on,
on another worker, to the very answer the one-process cluster gives (so the three ranks' tokens
before the kill are the one process's too). Both workers speculate (n-gram proposals, greedy:
the same tokens as without), so the ranks verify proposals in step and rank 0's accepted counts
reach the others."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import Cluster, wait_for
from tests.unit.worker.test_worker_tensor_parallel import ROOT, alive, children

pytestmark = pytest.mark.integration

QUESTIONS = ["Tell me about rivers.", "Write a short poem about the sea.",
             "Repeat this line three times: the river runs down to the sea.",
             "What is the capital of France?"]
MAX_TOKENS = 32
# The session cluster's flags (tests/conftest.py), so that only the split differs.
FLAGS = ["--dtype", "float32", "--num-gpu-blocks-override", "256", "--max-num-seqs", "32"]
SPECULATE = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']


def request(question: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=question)],
                              sampling=pb.SamplingParams(temperature=0),
                              stopping=pb.StoppingCriteria(max_tokens=MAX_TOKENS, ignore_eos=True))


def answers(stub) -> list[pb.GenerateResponse]:
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return list(pool.map(lambda q: stub.Generate(request(q), timeout=600), QUESTIONS))


@pytest.fixture(scope="module")
def tp_cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("tp-cluster") / "cluster.log"
    # --worker-timeout: above a forward's time while a new worker loads beside it on two cores.
    c = Cluster(*FLAGS, *SPECULATE, "--tensor-parallel-size", "3", "--worker-timeout", "20",
                log_path=log).start(timeout=600)
    yield c
    code = c.stop()
    assert code == 0, c.log_tail()


@pytest.fixture(scope="module")
def tp_stub(tp_cluster):
    with grpc.insecure_channel(tp_cluster.target) as channel:
        yield pagoda_pb2_grpc.GenerationStub(channel)


def tp_worker_pid(cluster: Cluster) -> int | None:
    """Rank 0 of the tensor-parallel worker (ids <host>-<pid>), once it runs a sequence."""
    for key, value in cluster.scheduler_metrics().items():
        if key.startswith("pagoda_num_requests_running{") and value > 0 and "spare" not in key:
            return int(key.split('worker="')[1].split('"')[0].rsplit("-", 1)[1])
    return None


def accepted(cluster: Cluster, worker: str) -> float:
    return sum(v for k, v in cluster.scheduler_metrics().items()
               if k.startswith("pagoda_spec_decode_num_accepted_tokens_total{") and worker in k)


def test_a_killed_rank_moves_its_streams_to_another_worker(stub, tp_cluster, tp_stub):
    one = answers(stub)  # the session's one-process cluster
    assert all(a.usage.completion_tokens == MAX_TOKENS for a in one)
    spare = subprocess.Popen(
        [sys.executable, "-m", "worker.main", *FLAGS[:4], *SPECULATE, "--worker-id", "spare",
         "--scheduler-worker-address", tp_cluster.worker_address,
         "--zmq-keys-dir", str(tp_cluster.keys_dir)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert tp_cluster.wait_for_workers(2, timeout=120), spare.poll()

        streamed = [0]

        def stream(question: str) -> list[int]:
            got = []
            for msg in tp_stub.GenerateStream(request(question), timeout=600):
                got += list(msg.token_ids)
                streamed[0] += len(msg.token_ids)
            return got

        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            streams = [pool.submit(stream, q) for q in QUESTIONS]
            assert wait_for(lambda: tp_worker_pid(tp_cluster) is not None, 120)
            rank0 = tp_worker_pid(tp_cluster)
            ranks = children(rank0)
            assert len(ranks) == 2
            assert wait_for(lambda: streamed[0] >= 8, 300)  # mid-generation
            assert tp_worker_pid(tp_cluster) == rank0
            assert wait_for(lambda: accepted(tp_cluster, f'-{rank0}"') > 0, 300)  # by three ranks
            os.kill(ranks[0], signal.SIGKILL)
            killed_at = time.monotonic()
            dead = f'-{rank0}"'
            assert wait_for(lambda: not any(dead in k for k in tp_cluster.scheduler_metrics()), 30)
            dropped_after = time.monotonic() - killed_at
            assert wait_for(lambda: not alive(rank0) and not alive(ranks[1]), 30)  # rank 2 too
            print(f"rank 1 killed: the scheduler dropped the worker after {dropped_after:.2f} s, "
                  f"all its ranks gone after {time.monotonic() - killed_at:.2f} s")
            # By its goodbye: well before --worker-timeout (20 s) would have dropped it.
            assert dropped_after < 10
            got = [s.result() for s in streams]
        assert got == [list(a.token_ids) for a in one]
        assert tp_cluster.metric("pagoda_kv_blocks_free") == tp_cluster.metric("pagoda_kv_blocks_total")
        log = tp_cluster.log_path.read_text()
        assert "a tensor-parallel rank is lost" in log and "worker0 exited with 1" in log
    finally:
        spare.send_signal(signal.SIGTERM)
        assert spare.wait(30) == 0
