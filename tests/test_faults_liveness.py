"""Liveness both ways, with real processes on loopback: the real scheduler and gateway, fake
worker processes (tests/fake_worker.py) whose deterministic outputs make every stream checkable
token by token. Each test prints its figure."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import wait_for
from tests.fake_cluster import NOT_SERVING, SERVING, FakeCluster, rss_bytes
from tests.fake_worker import reference_output


def request(i: int, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=[10 + i, 20 + i, 30 + i, 40],
                              sampling=pb.SamplingParams(seed=1000 + i),
                              stopping=pb.StoppingCriteria(max_tokens=max_tokens))


def expected(i: int, max_tokens: int) -> list[int]:
    return reference_output([10 + i, 20 + i, 30 + i, 40], max_tokens, seed=1000 + i)


class Stream(threading.Thread):
    """One GenerateStream read to its end in a thread: its tokens, and how and when it ended."""

    def __init__(self, stub, req: pb.GenerateRequest, timeout: float = 60) -> None:
        super().__init__(daemon=True)
        self.stub, self.req, self.timeout = stub, req, timeout
        self.tokens: list[int] = []
        self.token_times: list[float] = []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.ended_at = 0.0
        self.start()

    def run(self) -> None:
        try:
            for r in self.stub.GenerateStream(self.req, timeout=self.timeout):
                self.tokens += r.token_ids
                self.token_times += [time.monotonic()] * len(r.token_ids)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code, self.details = e.code(), e.details()
        self.ended_at = time.monotonic()


@pytest.fixture
def cluster(tmp_path):
    c = FakeCluster(tmp_path, worker_flags=["--num-blocks", "4096", "--step-delay", "0.01"])
    yield c
    c.stop()


def test_scheduler_killed_streams_end_unavailable_and_it_comes_back(cluster):
    cluster.start()
    streams = [Stream(cluster.stub, request(i, 3000)) for i in range(8)]
    assert wait_for(lambda: all(s.tokens for s in streams), 30), cluster.log_tail()
    killed = time.monotonic()
    cluster.kill(cluster.scheduler)
    for s in streams:
        s.join(10)
    waited = max(s.ended_at for s in streams) - killed
    print(f"\nscheduler killed: 8/8 streams ended UNAVAILABLE after at most {waited:.2f} s")
    assert [s.code for s in streams] == [grpc.StatusCode.UNAVAILABLE] * 8, [s.details for s in streams]
    assert waited < 6
    assert cluster.health_status() == NOT_SERVING
    for i, s in enumerate(streams):  # what did arrive was exact
        assert s.tokens == expected(i, 3000)[:len(s.tokens)]

    restarted = time.monotonic()
    cluster.start_scheduler()
    answer = None
    while answer is None and time.monotonic() - restarted < 10:
        try:
            answer = cluster.stub.Generate(request(0, 16), timeout=2)
        except grpc.RpcError:
            time.sleep(0.2)
    took = time.monotonic() - restarted
    print(f"scheduler restarted: first request served {took:.2f} s later")
    assert answer is not None and list(answer.token_ids) == expected(0, 16)
    assert cluster.health_status() == SERVING


def test_gateway_killed_its_requests_are_aborted_and_blocks_freed(cluster):
    cluster.start()
    streams = [Stream(cluster.stub, request(i, 3000)) for i in range(8)]
    assert wait_for(lambda: all(s.tokens for s in streams), 30), cluster.log_tail()
    assert cluster.metric("pagoda_num_requests_running") == 8
    killed = time.monotonic()
    cluster.kill(cluster.gateway)
    assert wait_for(cluster.idle_and_free, 10), cluster.scheduler_metrics()
    took = time.monotonic() - killed
    print(f"\ngateway killed: the scheduler ran 0 requests, every KV block free, {took:.2f} s later")
    assert cluster.metric("pagoda_kv_blocks_free") == 4096


def test_streams_nobody_reads_end_resource_exhausted_with_bounded_memory(tmp_path):
    cluster = FakeCluster(tmp_path, gateway_flags=["--max-unread-deltas", "64"],
                          worker_flags=["--num-blocks", "20000", "--step-delay", "0.005"])
    try:
        cluster.start()
        before = rss_bytes(cluster.gateway.pid)
        # A client that reads nothing and lets HTTP/2 flow control say so at once (no window
        # growth), rather than after megabytes sit in its own receive buffers.
        slow = grpc.insecure_channel(cluster.target, options=[
            ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)])
        unread = [pagoda_pb2_grpc.GenerationStub(slow).GenerateStream(request(i, 3000), timeout=120)
                  for i in range(20)]
        reader = Stream(cluster.stub, request(20, 600))  # the same bound, read as it comes
        assert wait_for(cluster.idle_and_free, 90), cluster.scheduler_metrics()
        grown = rss_bytes(cluster.gateway.pid) - before
        reader.join(30)
        codes, received = [], []
        for i, call in enumerate(unread):
            tokens = []
            try:
                for r in call:
                    tokens += r.token_ids
            except grpc.RpcError as e:
                codes.append(e.code())
            received.append(len(tokens))
            assert tokens == expected(i, 3000)[:len(tokens)]
        print(f"\n20 unread streams: gateway RSS grew {grown / 1e6:.1f} MB; they ended "
              f"{codes[0].name if codes else 'OK'} after {min(received)}..{max(received)} "
              f"of 3000 tokens; the stream read alongside got all {len(reader.tokens)}")
        assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 20
        assert max(received) < 3000 and grown < 50e6
        assert reader.code == grpc.StatusCode.OK and reader.tokens == expected(20, 600)
        slow.close()
    finally:
        cluster.stop()
