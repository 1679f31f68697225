"""Load at ten times what the stack admits, from a bounded generator on loopback that stops by
itself: every request is served token-exact or refused RESOURCE_EXHAUSTED, none hangs, nothing
leaks, the gateway's memory stays bounded. The stack is the real scheduler and gateway with a
fake worker process (the model is not the point)."""
from __future__ import annotations

import asyncio
import os
import random
import time

import grpc
import pytest

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import wait_for
from tests.fake_cluster import SERVING, FakeCluster, rss_bytes
from tests.fake_worker import reference_output

pytestmark = pytest.mark.integration

MAX_WAITING, MAX_RUNNING = 16, 8
CLIENTS = 10 * (MAX_WAITING + MAX_RUNNING)
# 30 s in `make test` (the suite's 20-minute bound); docs/faults.md's figures are of the issue's
# 60 s, PAGODA_LOAD_S=60.
LOAD_S = float(os.environ.get("PAGODA_LOAD_S", "30"))
DEADLINE_S = 30.0
RETRY_S = 0.05  # a refused client waits this long, as a client with a backoff would


def request(i: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=[3, 4, i % 97, i % 89],
                              sampling=pb.SamplingParams(seed=i),
                              stopping=pb.StoppingCriteria(max_tokens=8 + i % 24))


def expected(i: int) -> list[int]:
    return reference_output([3, 4, i % 97, i % 89], 8 + i % 24, seed=i)


async def load(target: str) -> tuple[list[float], int, list[str]]:
    """(latencies of the served, refused count, every other outcome) of LOAD_S seconds."""
    served: list[float] = []
    refused = 0
    wrong: list[str] = []
    counter = iter(range(10**9))
    stop_at = time.monotonic() + LOAD_S
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pagoda_pb2_grpc.GenerationStub(channel)

        async def client() -> None:
            nonlocal refused
            while time.monotonic() < stop_at:
                i = next(counter)
                started = time.monotonic()
                try:
                    tokens = []
                    async for r in stub.GenerateStream(request(i), timeout=DEADLINE_S):
                        tokens += r.token_ids
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        refused += 1
                        await asyncio.sleep(RETRY_S * (0.5 + random.random()))
                        continue
                    wrong.append(f"request {i}: {e.code().name} {e.details()}")
                    continue
                if tokens != expected(i):
                    wrong.append(f"request {i}: {len(tokens)} tokens, not the reference's")
                served.append(time.monotonic() - started)

        await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return served, refused, wrong


def test_ten_times_the_admitted_concurrency_is_served_or_refused_and_nothing_leaks(tmp_path):
    with FakeCluster(tmp_path, gateway_address_space=3 << 30,
                     scheduler_flags=["--max-waiting-requests", str(MAX_WAITING),
                                      "--max-num-seqs", str(MAX_RUNNING)],
                     worker_flags=["--num-gpu-blocks-override", "4096", "--step-delay", "0.005"]) as cluster:
        cluster.start()
        before = rss_bytes(cluster.gateway.pid)
        served, refused, wrong = asyncio.run(load(cluster.target))
        grown = rss_bytes(cluster.gateway.pid) - before
        served.sort()
        p50, p99 = served[len(served) // 2], served[int(len(served) * 0.99)]
        print(f"\n{CLIENTS} clients for {LOAD_S:g} s: {len(served)} served "
              f"(p50 {p50 * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms), {refused} refused, "
              f"{len(wrong)} otherwise; gateway RSS grew {grown / 1e6:.1f} MB")
        assert wrong == []
        assert served and refused
        assert wait_for(cluster.idle_and_free, 30), cluster.scheduler_metrics()
        assert grown < 200e6
        assert cluster.health_status() == SERVING
