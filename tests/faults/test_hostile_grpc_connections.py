"""Idle connections on the gRPC port against the real stack (scheduler, gateway, fake worker
processes): a client holds 1,100 connections that sent HTTP/2's preface and then nothing, from 20
addresses (127.0.0.2..21) or from one. The gateway's front (gateway/bounds/grpc_front.py) holds at most
--max-grpc-connections-per-peer of one address, and when its total is full a newcomer holding
fewer takes the place of the biggest holder's least recently active connection. Meanwhile tenant
B's stream from 127.0.0.1 runs token-exact, a keyed Generate from a fresh channel is served
token-exact, a health check from a fresh connection answers SERVING within 1 s, and the gateway's
RSS grows less than 100 MB. A connection that sends nothing is closed by the front after
--grpc-handshake-timeout, before grpc ever sees it."""
from __future__ import annotations

import socket
import struct
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import free_port, read_metrics, sum_metric, wait_for
from tests.fake_cluster import SERVING, FakeCluster, rss_bytes
from tests.fake_worker import reference_output
from tests.streams import Stream

pytestmark = pytest.mark.integration

KEY_A, KEY_B = "tenant-a-secret", "tenant-b-secret"
AUTH_A, AUTH_B = (("authorization", f"Bearer {KEY_A}"),), (("authorization", f"Bearer {KEY_B}"),)
CONNECTIONS, TOTAL, PER_PEER = 1_100, 1024, 64
HANDSHAKE = 3.0
RSS_GROWTH = 100e6
# HTTP/2's client preface and an empty SETTINGS frame: what a channel sends before any call.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + struct.pack(">I", 0)[1:] + bytes((4, 0)) + bytes(4)
REFUSED, EVICTED = ("pagoda_gateway_grpc_connections_refused_total",
                    "pagoda_gateway_grpc_connections_evicted_total")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    c = FakeCluster(
        tmp_path_factory.mktemp("hostile_grpc_connections"), gateway_address_space=3 << 30,
        gateway_flags=["--api-key", KEY_A, "--api-key", KEY_B,
                       "--max-grpc-connections", str(TOTAL),
                       "--max-grpc-connections-per-peer", str(PER_PEER),
                       "--grpc-handshake-timeout", str(HANDSHAKE),
                       "--grpc-max-connection-idle", "60"],
        worker_flags=["--num-gpu-blocks-override", "20000", "--step-delay", "0.01"])
    c.gateway_metrics_port = free_port()
    c.gateway_flags += ["--gateway-metrics-port", str(c.gateway_metrics_port)]
    yield c.start()
    c.stop()


def gateway_metric(stack, name: str, label: str = "") -> float:
    metrics = read_metrics(stack.gateway_metrics_port)
    if label:
        return sum(v for k, v in metrics.items() if k.startswith(name + "{") and label in k)
    return sum_metric(metrics, name)


def hold(stack, addresses: list[str]) -> list[socket.socket]:
    """One connection from each address, in order, each sending the preface and then nothing."""
    socks = []
    for address in addresses:
        sock = socket.socket()
        sock.bind((address, 0))
        sock.settimeout(5)
        socks.append(sock)
        try:
            sock.connect(("127.0.0.1", stack.grpc_port))
            sock.sendall(PREFACE)
        except (ConnectionResetError, BrokenPipeError):
            sock.close()  # refused already (its reset can come before connect returns)
            continue
        sock.setblocking(False)
    return socks


def is_open(sock: socket.socket) -> bool:
    if sock.fileno() < 0:
        return False
    try:
        while sock.recv(1 << 16):  # grpc's SETTINGS and its ack, on the admitted ones
            pass
        return False
    except BlockingIOError:
        return True
    except OSError:  # reset: refused or evicted
        return False


def open_count(socks: list[socket.socket]) -> int:
    return sum(is_open(sock) for sock in socks)


def victim(stack, i: int, max_tokens: int) -> Stream:
    req = pb.GenerateRequest(prompt_token_ids=[7, 8, 9, 100 + i], sampling=pb.SamplingParams(seed=i),
                             stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))
    stream = Stream(stack.stub, req, metadata=AUTH_B)
    assert wait_for(lambda: stream.tokens, 10)
    return stream


def fresh_channel(stack, opened: list[grpc.Channel]) -> grpc.Channel:
    """A channel with a connection of its own, from 127.0.0.1; the caller closes `opened`."""
    channel = grpc.insecure_channel(stack.target, options=[("grpc.use_local_subchannel_pool", 1)])
    opened.append(channel)
    return channel


def check_a_fresh_channel_is_served(stack, opened: list[grpc.Channel]) -> None:
    """A keyed Generate on a connection of its own, token-exact."""
    r = pagoda_pb2_grpc.GenerationStub(fresh_channel(stack, opened)).Generate(pb.GenerateRequest(
        prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(seed=3),
        stopping=pb.StoppingCriteria(max_tokens=8, ignore_eos=True)),
        metadata=AUTH_A, timeout=5)
    assert list(r.token_ids) == reference_output([1, 2, 3], 8, seed=3, ignore_eos=True)


def check_health_from_a_fresh_connection(stack, opened: list[grpc.Channel]) -> float:
    """Readiness from a channel of its own: SERVING within 1 s of opening it."""
    started = time.monotonic()
    reply = health_pb2_grpc.HealthStub(fresh_channel(stack, opened)).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=1)
    took = time.monotonic() - started
    assert reply.status == SERVING and took < 1.0
    return took


def check_undisturbed(stack, stream: Stream, i: int, max_tokens: int, rss_before: int) -> None:
    stream.join(60)
    assert stream.code == grpc.StatusCode.OK, stream.details
    assert stream.tokens == reference_output([7, 8, 9, 100 + i], max_tokens, seed=i,
                                             ignore_eos=True)
    grown = rss_bytes(stack.gateway.pid) - rss_before
    print(f"the gateway's RSS grew {grown / 1e6:.1f} MB")
    assert grown < RSS_GROWTH


def close_all(socks: list[socket.socket], channels: list[grpc.Channel]) -> None:
    for sock in socks:
        sock.close()
    for channel in channels:
        channel.close()


def test_idle_connections_from_many_addresses_cannot_keep_a_new_client_out(stack):
    rss_before = rss_bytes(stack.gateway.pid)
    evicted_before = gateway_metric(stack, EVICTED)
    refused_before = gateway_metric(stack, REFUSED, 'reason="total"')
    stream = victim(stack, 1, 400)
    started = time.monotonic()
    socks = hold(stack, [f"127.0.0.{2 + i % 20}" for i in range(CONNECTIONS)])
    channels: list[grpc.Channel] = []
    try:
        print(f"\n{CONNECTIONS} connections from 20 addresses opened in "
              f"{time.monotonic() - started:.2f} s")
        # The total is full: the stack's own channel holds one, the attack the rest.
        assert wait_for(lambda: open_count(socks) == TOTAL - 1, 10)
        took = check_health_from_a_fresh_connection(stack, channels)
        check_a_fresh_channel_is_served(stack, channels)
        print(f"health from a fresh connection answered in {took * 1000:.0f} ms")
        # Past the total, each attacker's newcomer either took a bigger holder's place or (its
        # address holding as many as any) was refused; both fresh connections (still open) took
        # one. No address reached its own bound.
        evicted = gateway_metric(stack, EVICTED) - evicted_before
        refused = gateway_metric(stack, REFUSED, 'reason="total"') - refused_before
        print(f"{evicted:.0f} evicted, {refused:.0f} refused")
        assert evicted + refused == CONNECTIONS - (TOTAL - 1) + 2 and evicted >= 2
        assert gateway_metric(stack, REFUSED, 'reason="per_peer"') == 0
        assert open_count(socks) == TOTAL - 1 - 2  # still held, less the two places taken
        check_undisturbed(stack, stream, 1, 400, rss_before)
    finally:
        close_all(socks, channels)
    assert wait_for(lambda: gateway_metric(stack, "pagoda_gateway_grpc_connections") <= 2, 10)


def test_one_address_holds_at_most_its_bound(stack):
    rss_before = rss_bytes(stack.gateway.pid)
    refused_before = gateway_metric(stack, REFUSED, 'reason="per_peer"')
    stream = victim(stack, 2, 400)
    socks = hold(stack, ["127.0.0.2"] * CONNECTIONS)
    channels: list[grpc.Channel] = []
    try:
        # The first PER_PEER are held; every one past them was closed at once.
        assert wait_for(lambda: [is_open(s) for s in socks] == [True] * PER_PEER
                        + [False] * (CONNECTIONS - PER_PEER), 10)
        assert (gateway_metric(stack, REFUSED, 'reason="per_peer"') - refused_before
                == CONNECTIONS - PER_PEER)
        check_health_from_a_fresh_connection(stack, channels)
        check_a_fresh_channel_is_served(stack, channels)
        # The (bound + 1)-th, once more: closed at once, the bound's own still open.
        extra = hold(stack, ["127.0.0.2"])[0]
        assert wait_for(lambda: not is_open(extra), 1)
        extra.close()
        assert open_count(socks) == PER_PEER
        check_undisturbed(stack, stream, 2, 400, rss_before)
    finally:
        close_all(socks, channels)


def test_a_connection_that_sends_nothing_is_closed_by_the_front(stack):
    silent_before = gateway_metric(stack, REFUSED, 'reason="silent"')
    sock = socket.create_connection(("127.0.0.1", stack.grpc_port), source_address=("127.0.0.2", 0))
    sock.settimeout(HANDSHAKE + 5)
    started = time.monotonic()
    try:
        with pytest.raises(ConnectionResetError):
            assert sock.recv(1024) == b""  # grpc never saw it: not even its SETTINGS came
        took = time.monotonic() - started
        print(f"\na connection that sent nothing was reset after {took:.1f} s "
              f"(--grpc-handshake-timeout {HANDSHAKE:g})")
        assert HANDSHAKE * 0.9 < took < HANDSHAKE + 2
        assert gateway_metric(stack, REFUSED, 'reason="silent"') == silent_before + 1
    finally:
        sock.close()
