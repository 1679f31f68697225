"""Gateway traffic cannot make the scheduler drop a live worker or break its link numbering, and a
request that kills worker after worker ends. Real scheduler (and gateway) processes, fake worker
processes (tests/fake_worker_main.py), raw ZeroMQ DEALERs as hostile gateway peers. Each test
prints its figure."""
from __future__ import annotations

import re
import time

import grpc
import pytest
import zmq

from proto import internal_pb2 as ipb, pagoda_pb2 as pb
from proto.auth import PROTOCOL_VERSION, secure_client
from tests.cluster import wait_for
from tests.fake_cluster import SERVING, FakeCluster
from tests.fake_worker import DIE_MARK, reference_output

pytestmark = pytest.mark.integration


def gateway_peer(cluster: FakeCluster, routing_id: bytes, hwm: int = 1000) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.SNDTIMEO, 30_000)  # pushed back, never forever
    secure_client(sock, cluster.keys_flags[1], "gateway")  # an authenticated gateway
    sock.connect(cluster.gateway_address)
    return ctx, sock


HELLO = ipb.GatewayMessage(hello=ipb.GatewayHello(protocol_version=PROTOCOL_VERSION)).SerializeToString()


def normal_request(max_tokens: int = 16) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=[10, 20, 30, 40], sampling=pb.SamplingParams(seed=3),
                              stopping=pb.StoppingCriteria(max_tokens=max_tokens))


def test_a_flood_of_adds_drops_no_worker_and_the_gateway_serves_on(tmp_path):
    # Half the default --worker-timeout: a loop that served the flood before the heartbeats
    # (as it once did) drops the worker within the flood's first second.
    with FakeCluster(tmp_path, scheduler_flags=["--worker-timeout", "0.75"],
                     worker_flags=["--num-gpu-blocks-override", "4096"]) as cluster:
        cluster.start()
        # Its receive queue is unbounded, so that every answer can be counted afterwards.
        ctx, flood = gateway_peer(cluster, b"hostile", hwm=0)
        n = 50_000
        adds = [ipb.GatewayMessage(add=ipb.AddRequest(
            request_id=f"flood-{i}", prompt_token_ids=[1 + i % 900, 2, 3], max_tokens=2,
            sampling=ipb.SamplingConfig())).SerializeToString() for i in range(n)]
        started = time.monotonic()
        flood.send(HELLO)
        for data in adds:  # as fast as the high-water mark lets it, reading nothing meanwhile
            flood.send(data)
        sent_in = time.monotonic() - started
        workers_seen, ends, seqs = {cluster.num_workers()}, {}, []
        last_look = 0.0
        while len(ends) < n and flood.poll(10_000):
            msg = ipb.SchedulerMessage()
            msg.ParseFromString(flood.recv())
            seqs.append(msg.seq)
            for d in msg.deltas:
                if d.finish:
                    assert d.request_id not in ends, d.request_id  # one answer each
                    ends[d.request_id] = d.error.code or ipb.Finish.Name(d.finish)
            if time.monotonic() - last_look > 0.2:
                workers_seen.add(cluster.num_workers())
                last_look = time.monotonic()
        answered_in = time.monotonic() - started
        flood.close(0)
        ctx.term()
        answer = cluster.stub.Generate(normal_request(), timeout=10)
        log = (tmp_path / "scheduler.log").read_text()
        outcomes = {k: list(ends.values()).count(k) for k in set(ends.values())}
        print(f"\n{n} adds from one gateway peer, sent in {sent_in:.1f} s, all answered in "
              f"{answered_in:.1f} s ({outcomes}); workers seen {sorted(workers_seen)}, none "
              f"dropped; a normal request after it answered token-exact")
        assert len(ends) == n and set(outcomes) == {"LENGTH", "RESOURCE_EXHAUSTED"}
        assert seqs == list(range(1, len(seqs) + 1))  # nothing was lost on the way
        assert workers_seen == {1} and "dropped (" not in log, cluster.log_tail()
        assert not re.search(r"gateway b'gateway-[^']*' silent", log)  # the real one kept its lease
        assert list(answer.token_ids) == reference_output([10, 20, 30, 40], 16, seed=3)
        assert wait_for(cluster.idle_and_free, 10), cluster.scheduler_metrics()
        assert cluster.health_status() == SERVING


def read_all(sock: zmq.Socket, quiet_ms: int = 300) -> list[ipb.SchedulerMessage]:
    out = []
    while sock.poll(quiet_ms):
        msg = ipb.SchedulerMessage()
        msg.ParseFromString(sock.recv())
        out.append(msg)
    return out


def test_a_gateway_silent_past_its_timeout_and_heard_again_gets_its_link_numbers_on(tmp_path):
    with FakeCluster(tmp_path, scheduler_flags=["--gateway-timeout", "1"],
                     worker_flags=["--step-delay", "0.02"]) as cluster:
        cluster.start_scheduler()
        cluster.start_worker()
        assert wait_for(lambda: cluster.num_workers() == 1, 30), cluster.log_tail()
        ctx, sock = gateway_peer(cluster, b"sleepy")
        sock.send(HELLO)
        sock.send(ipb.GatewayMessage(add=ipb.AddRequest(
            request_id="long", prompt_token_ids=[5, 6, 7], max_tokens=1000,
            sampling=ipb.SamplingConfig())).SerializeToString())
        # Its info, then tokens, while it says nothing: after 1 s its request ends UNAVAILABLE.
        before = read_all(sock)
        assert before and before[0].HasField("info")
        assert wait_for(lambda: "gateway b'sleepy' silent" in (tmp_path / "scheduler.log").read_text(), 10)
        sock.send(HELLO)  # heard again
        after = read_all(sock)
        sock.close(0)
        ctx.term()
        messages = before + after
        ends = [(d.request_id, d.error.code) for m in messages for d in m.deltas if d.finish]
        print(f"\ngateway silent past --gateway-timeout 1, then a hello: {len(before)} messages "
              f"before, {len(after)} after, seq {messages[0].seq}..{messages[-1].seq} under one "
              f"epoch; its request ended {ends[0][1] if ends else None}")
        assert [m.seq for m in messages] == list(range(1, len(messages) + 1))  # no repeat, no gap
        assert len({m.epoch for m in messages}) == 1
        assert ends == [("long", "UNAVAILABLE")]
        assert len(after) == 1 and after[0].HasField("info")  # the answer to its hello


def test_a_request_that_kills_its_worker_twice_ends_internal(tmp_path):
    with FakeCluster(tmp_path, worker_flags=["--num-gpu-blocks-override", "256"]) as cluster:
        cluster.start_scheduler()
        doomed = [cluster.start_worker("--die-on-mark") for _ in range(2)]
        cluster.start_gateway()
        assert cluster.wait_health(SERVING, 30), cluster.log_tail()
        assert wait_for(lambda: cluster.num_workers() == 2, 30), cluster.log_tail()
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            cluster.stub.Generate(pb.GenerateRequest(
                prompt_token_ids=[DIE_MARK, 0, 7, 8], stopping=pb.StoppingCriteria(max_tokens=8)),
                timeout=15)
        took = time.monotonic() - started
        print(f"\na request whose step kills its worker: {e.value.code().name} after {took:.1f} s "
              f"and 2 dead workers: {e.value.details()}")
        assert e.value.code() == grpc.StatusCode.INTERNAL
        assert "failed on 2 workers in a row" in e.value.details()
        assert [p.wait(5) for p in doomed] == [1, 1]
        cluster.start_worker()  # a healthy one: nothing of the killer is left to run on it
        assert wait_for(lambda: cluster.num_workers() == 1, 30), cluster.log_tail()
        assert cluster.wait_health(SERVING, 10)
        answer = cluster.stub.Generate(normal_request(), timeout=10)
        assert list(answer.token_ids) == reference_output([10, 20, 30, 40], 16, seed=3)
        assert wait_for(cluster.idle_and_free, 5), cluster.scheduler_metrics()
        assert cluster.metric("pagoda_kv_blocks_free") == 256
