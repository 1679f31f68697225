"""Liveness both ways, with real processes on loopback: the real scheduler and gateway, fake
worker processes (tests/fake_worker.py) whose deterministic outputs make every stream checkable
token by token. Each test prints its figure."""
from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import wait_for
from tests.fake_cluster import NOT_SERVING, SERVING, FakeCluster, rss_bytes
from tests.fake_worker import reference_output
from tests.streams import Stream


def request(i: int, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=[10 + i, 20 + i, 30 + i, 40],
                              sampling=pb.SamplingParams(seed=1000 + i),
                              stopping=pb.StoppingCriteria(max_tokens=max_tokens))


def expected(i: int, max_tokens: int) -> list[int]:
    return reference_output([10 + i, 20 + i, 30 + i, 40], max_tokens, seed=1000 + i)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Shared by the kill tests; each leaves it serving again."""
    c = FakeCluster(tmp_path_factory.mktemp("kills"),
                    worker_flags=["--num-gpu-blocks-override", "4096", "--step-delay", "0.01"]).start()
    yield c
    c.stop()


def test_scheduler_killed_streams_end_unavailable_and_it_comes_back(cluster):
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
    streams = [Stream(cluster.stub, request(i, 3000)) for i in range(8)]
    assert wait_for(lambda: all(s.tokens for s in streams), 30), cluster.log_tail()
    assert cluster.metric("pagoda_num_requests_running") == 8
    killed = time.monotonic()
    cluster.kill(cluster.gateway)
    assert wait_for(cluster.idle_and_free, 10), cluster.scheduler_metrics()
    took = time.monotonic() - killed
    print(f"\ngateway killed: the scheduler ran 0 requests, every KV block free, {took:.2f} s later")
    assert cluster.metric("pagoda_kv_blocks_free") == 4096
    cluster.start_gateway()
    assert cluster.wait_health(SERVING, 30)


def test_streams_nobody_reads_end_resource_exhausted_with_bounded_memory(tmp_path):
    with FakeCluster(tmp_path, gateway_flags=["--max-unread-deltas", "64"], worker_flags=[
            "--num-gpu-blocks-override", "20000", "--step-delay", "0.005"]) as cluster:
        cluster.start()
        before = rss_bytes(cluster.gateway.pid)
        # A client that reads nothing and lets HTTP/2 flow control say so at once (no window
        # growth), rather than after megabytes sit in its own receive buffers.
        slow = grpc.insecure_channel(cluster.target, options=[
            ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)])
        unread = [pagoda_pb2_grpc.GenerationStub(slow).GenerateStream(request(i, 3000), timeout=120)
                  for i in range(20)]
        reader = Stream(cluster.stub, request(20, 200))  # the same bound, read as it comes
        assert wait_for(lambda: reader.tokens, 30)  # all 21 run (the reader came last)
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
        assert reader.code == grpc.StatusCode.OK and reader.tokens == expected(20, 200)
        slow.close()


def test_killed_worker_survivor_takes_over_then_no_worker_means_unavailable(tmp_path):
    with FakeCluster(tmp_path, scheduler_flags=["--no-worker-timeout", "2"], worker_flags=[
            "--num-gpu-blocks-override", "4096", "--step-delay", "0.02"]) as cluster:
        cluster.start(num_workers=2)
        streams = [Stream(cluster.stub, request(i, 120)) for i in range(8)]
        assert wait_for(lambda: all(len(s.tokens) >= 10 for s in streams), 30), cluster.log_tail()
        loads = cluster.stub.GetLoads(pb.GetLoadsRequest(), timeout=5)
        assert sorted(w.running for w in loads.workers) == [4, 4]  # both hold streams
        killed = time.monotonic()
        cluster.kill(cluster.workers[0])
        for s in streams:
            s.join(60)
        # The longest a stream waited for its next token across the kill.
        stall = max(max(b - a for a, b in zip(s.token_times, s.token_times[1:])) for s in streams)
        print(f"\nworker killed mid-step: its streams resumed on the survivor after at most "
              f"{stall:.2f} s, 8/8 token-exact")
        assert [s.code for s in streams] == [grpc.StatusCode.OK] * 8
        for i, s in enumerate(streams):
            assert s.tokens == expected(i, 120)
        assert stall < 2.0 and killed < max(s.token_times[-1] for s in streams)

        waiting = [Stream(cluster.stub, request(i, 3000)) for i in range(2)]
        assert wait_for(lambda: all(s.tokens for s in waiting), 30)
        gone = time.monotonic()
        cluster.kill(cluster.workers[1])
        for s in waiting:
            s.join(15)
        took = max(s.ended_at for s in waiting) - gone
        print(f"no worker left: waiting requests ended UNAVAILABLE {took:.2f} s later "
              f"(--no-worker-timeout 2, --worker-timeout 1.5)")
        assert [s.code for s in waiting] == [grpc.StatusCode.UNAVAILABLE] * 2
        assert "no worker" in waiting[0].details and took < 2 + 1.5 + 1


def storm_request(i: int, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=[1 + i % 997, 1 + (i * 7) % 997, 40],
                              sampling=pb.SamplingParams(seed=i),
                              stopping=pb.StoppingCriteria(max_tokens=max_tokens))


def test_cancel_storm_leaks_nothing_and_the_rest_is_token_exact(tmp_path):
    with FakeCluster(tmp_path, worker_flags=["--num-gpu-blocks-override", "1024"]) as cluster:
        cluster.start()
        rng = random.Random(10)
        # (index, max_tokens, None or how many responses to read before cancelling)
        plan = [(i, rng.randint(2, 24), rng.randint(0, 6) if rng.random() < 0.3 else None)
                for i in range(1000)]
        wrong, cancelled, failed = [], [], []

        def client(share) -> None:
            for i, max_tokens, cancel_after in share:
                call = cluster.stub.GenerateStream(storm_request(i, max_tokens), timeout=60)
                tokens, read = [], 0
                try:
                    if cancel_after == 0:
                        call.cancel()
                    for r in call:
                        tokens += r.token_ids
                        read += 1
                        if read == cancel_after:
                            call.cancel()
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.CANCELLED or cancel_after is None:
                        failed.append((i, e.code(), e.details()))
                if cancel_after is not None:
                    cancelled.append(i)
                elif tokens != reference_output(list(storm_request(i, 1).prompt_token_ids),
                                                max_tokens, seed=i):
                    wrong.append(i)

        started = time.monotonic()
        clients = [threading.Thread(target=client, args=(plan[k::16],)) for k in range(16)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(300)
        took = time.monotonic() - started
        assert wait_for(cluster.idle_and_free, 10), cluster.scheduler_metrics()
        m = cluster.scheduler_metrics()
        leaked = cluster.metric("pagoda_kv_blocks_total") - cluster.metric("pagoda_kv_blocks_free")
        print(f"\ncancel storm: 1000 requests over 16 clients in {took:.1f} s, {len(cancelled)} "
              f"cancelled; at idle {leaked:.0f} leaked blocks, "
              f"{cluster.metric('pagoda_num_requests_running'):.0f} running; "
              f"{1000 - len(cancelled) - len(wrong)} of {1000 - len(cancelled)} others token-exact")
        assert failed == [] and wrong == []
        assert leaked == 0 and cluster.metric("pagoda_num_requests_running") == 0, m


def test_overload_fills_the_queue_to_its_bound_and_refuses_the_rest(tmp_path):
    # 16 blocks of 4 tokens hold 4 requests of 3 + 10 tokens (and --max-num-seqs 4 runs no
    # more, so nothing is preempted back into the queue); 40 arrive together.
    with FakeCluster(tmp_path, scheduler_flags=["--max-waiting-requests", "8", "--max-num-seqs", "4"],
                     worker_flags=["--num-gpu-blocks-override", "16", "--step-delay", "0.05"]) as cluster:
        cluster.start()
        before = rss_bytes(cluster.scheduler.pid)
        peak, done = [0.0], threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], cluster.metric("pagoda_num_requests_waiting"))
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        streams = [Stream(cluster.stub, storm_request(i, 10)) for i in range(40)]
        for s in streams:
            s.join(60)
        done.set()
        watcher.join()
        grown = rss_bytes(cluster.scheduler.pid) - before
        ok = [i for i, s in enumerate(streams) if s.code == grpc.StatusCode.OK]
        refused = [s for s in streams if s.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
        print(f"\noverload 10x: {len(ok)} admitted and completed token-exact, {len(refused)} "
              f"RESOURCE_EXHAUSTED; peak waiting {peak[0]:.0f} (bound 8); scheduler RSS grew "
              f"{grown / 1e6:.1f} MB")
        assert len(ok) + len(refused) == 40 and refused and peak[0] == 8
        # Refused by the gateway, which holds no more in flight than the scheduler can
        # (ClusterInfo.max_sequences: 8 waiting + 4 running), or, for adds that arrive before a
        # step moves any to running, by the scheduler's waiting bound.
        assert all(s.details.startswith(("the scheduler is full", "the waiting queue is full"))
                   for s in refused), [s.details for s in refused]
        for i in ok:
            assert streams[i].tokens == reference_output(
                list(storm_request(i, 1).prompt_token_ids), 10, seed=i)
        assert grown < 20e6
        assert wait_for(cluster.idle_and_free, 10)


def test_a_step_longer_than_the_worker_timeout_does_not_drop_the_worker(tmp_path):
    # Each step takes 2 s, longer than --worker-timeout (1.5 s): only the heartbeat thread
    # keeps the worker registered while it runs.
    with FakeCluster(tmp_path, worker_flags=["--step-delay", "2.0"]) as cluster:
        cluster.start()
        started = time.monotonic()
        answer = cluster.stub.Generate(request(0, 2), timeout=30)
        took = time.monotonic() - started
        log = (tmp_path / "scheduler.log").read_text()
        print(f"\n2 steps of 2 s each (--worker-timeout 1.5): answered in {took:.1f} s, "
              f"worker kept")
        assert list(answer.token_ids) == expected(0, 2) and took >= 4
        assert "dropped" not in log and cluster.num_workers() == 1
