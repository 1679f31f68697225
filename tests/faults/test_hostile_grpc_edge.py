"""Half-open gRPC calls against the real stack (scheduler, gateway, fake worker processes): one
client, bound to 127.0.0.2, opens 1,100 calls and never sends their messages, without a key and
then with one (tests/half_open_grpc.py writes the HTTP/2 itself: grpc's client cannot choose its
local address). Meanwhile tenant B's stream from 127.0.0.1 runs token-exact, health (readiness
and liveness) answers within 1 s, a keyed Generate from a fresh channel is served, and the
gateway's RSS grows less than 100 MB; afterwards the attacker's connections, idle, are closed."""
from __future__ import annotations

import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import wait_for
from tests.fake_cluster import SERVING, FakeCluster, rss_bytes
from tests.fake_worker import reference_output
from tests.half_open_grpc import HalfOpenClient
from tests.streams import Stream

pytestmark = pytest.mark.integration

KEY_A, KEY_B = "tenant-a-secret", "tenant-b-secret"
AUTH_A, AUTH_B = (("authorization", f"Bearer {KEY_A}"),), (("authorization", f"Bearer {KEY_B}"),)
ATTACKER = "127.0.0.2"
CALLS, PER_CONNECTION = 1_100, 550   # two connections: below --max-streams-per-connection
PER_PEER = 64
FIRST_MESSAGE_TIMEOUT = 3.0
IDLE = 2.0
HANDSHAKE = 1.0
RSS_GROWTH = 100e6
METHODS = ("/pagoda.v1.Generation/Generate", "/pagoda.v1.Generation/GenerateStream")
OK_STATUS, UNAUTHENTICATED, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED = "0", "16", "8", "4"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    c = FakeCluster(
        tmp_path_factory.mktemp("hostile_grpc"), gateway_address_space=3 << 30,
        gateway_flags=["--api-key", KEY_A, "--api-key", KEY_B,
                       "--max-rpcs-per-peer", str(PER_PEER),
                       "--grpc-first-message-timeout", str(FIRST_MESSAGE_TIMEOUT),
                       "--grpc-max-connection-idle", str(IDLE),
                       "--grpc-handshake-timeout", str(HANDSHAKE)],
        worker_flags=["--num-gpu-blocks-override", "20000", "--step-delay", "0.01"]).start()
    yield c
    c.stop()


def victim(stack, i: int, max_tokens: int) -> Stream:
    req = pb.GenerateRequest(prompt_token_ids=[7, 8, 9, 100 + i], sampling=pb.SamplingParams(seed=i),
                             stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))
    stream = Stream(stack.stub, req, metadata=AUTH_B)
    assert wait_for(lambda: stream.tokens, 10)
    return stream


def check_undisturbed(stack, stream: Stream, i: int, max_tokens: int, rss_before: int) -> None:
    stream.join(60)
    assert stream.code == grpc.StatusCode.OK, stream.details
    assert stream.tokens == reference_output([7, 8, 9, 100 + i], max_tokens, seed=i,
                                             ignore_eos=True)
    check_health(stack)
    assert wait_for(stack.idle_and_free, 30), stack.scheduler_metrics()
    grown = rss_bytes(stack.gateway.pid) - rss_before
    print(f"the gateway's RSS grew {grown / 1e6:.1f} MB")
    assert grown < RSS_GROWTH


def check_health(stack) -> None:
    """Readiness and liveness each answer SERVING within 1 s."""
    for name in ("", "liveness"):
        started = time.monotonic()
        reply = stack.health.Check(health_pb2.HealthCheckRequest(service=name), timeout=1)
        assert reply.status == SERVING and time.monotonic() - started < 1.0


def check_a_fresh_channel_is_served(stack) -> None:
    """A keyed Generate on a connection of its own (the attacker's are another address's)."""
    channel = grpc.insecure_channel(stack.target, options=[("grpc.use_local_subchannel_pool", 1)])
    try:
        r = pagoda_pb2_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
            prompt_token_ids=[1, 2, 3], stopping=pb.StoppingCriteria(max_tokens=2)),
            metadata=AUTH_A, timeout=5)
        assert len(r.token_ids) == 2
    finally:
        channel.close()


def attack(stack, metadata=()) -> list[HalfOpenClient]:
    """CALLS half-open calls from ATTACKER over two connections, both methods alike."""
    clients = [HalfOpenClient(stack.target, ATTACKER) for _ in range(CALLS // PER_CONNECTION)]
    for client in clients:
        for i in range(PER_CONNECTION):
            client.open(METHODS[i % 2], metadata)
    return clients


def ends(clients: list[HalfOpenClient]) -> list[tuple[str | None, float]]:
    """Each call's (grpc-status, seconds from its headers to its end)."""
    return [(status, at - c.opened[stream]) for c in clients
            for stream, (at, status, _message) in c.ended.items()]


def test_half_open_calls_without_a_key_are_refused_at_once(stack):
    rss_before = rss_bytes(stack.gateway.pid)
    stream = victim(stack, 1, 400)
    clients = attack(stack)
    try:
        check_health(stack)
        check_a_fresh_channel_is_served(stack)
        assert wait_for(lambda: len(ends(clients)) == CALLS, 30)
        statuses = [status for status, _ in ends(clients)]
        assert statuses == [UNAUTHENTICATED] * CALLS
        slowest = max(took for _, took in ends(clients))
        print(f"\n{CALLS} half-open calls without a key: the slowest refused after {slowest:.2f} s")
        assert slowest < FIRST_MESSAGE_TIMEOUT  # none waited for its message
        assert all(message.startswith("missing or unknown API key")
                   for c in clients for _, _, message in c.ended.values())
        check_undisturbed(stack, stream, 1, 400, rss_before)
    finally:
        for client in clients:
            client.close()


def test_half_open_calls_with_a_key_hold_the_peers_share_until_the_deadline(stack):
    rss_before = rss_bytes(stack.gateway.pid)
    stream = victim(stack, 2, 400)
    opened = time.monotonic()
    clients = attack(stack, AUTH_A)
    try:
        # The peer's share is taken and the rest refused; the share is still held meanwhile.
        assert wait_for(lambda: len(ends(clients)) == CALLS - PER_PEER, 10)
        assert time.monotonic() - opened < FIRST_MESSAGE_TIMEOUT
        check_health(stack)
        check_a_fresh_channel_is_served(stack)
        assert len(ends(clients)) == CALLS - PER_PEER
        assert {status for status, _ in ends(clients)} == {RESOURCE_EXHAUSTED}
        message = next(iter(clients[0].ended.values()))[2]
        assert message.startswith(f"this client ({ATTACKER}) has {PER_PEER} calls in flight")
        # Then the deadline ends the share's calls and frees their slots.
        assert wait_for(lambda: len(ends(clients)) == CALLS, FIRST_MESSAGE_TIMEOUT + 10)
        held = sorted(took for status, took in ends(clients) if status == DEADLINE_EXCEEDED)
        print(f"\n{CALLS} keyed half-open calls: {CALLS - len(held)} refused at once, {len(held)} "
              f"ended after {held[0]:.2f} to {held[-1]:.2f} s")
        assert len(held) == PER_PEER and held[0] >= FIRST_MESSAGE_TIMEOUT
        check_health(stack)
        check_undisturbed(stack, stream, 2, 400, rss_before)
        # Without calls, the attacker's connections are idle: GOAWAY and closed.
        assert wait_for(lambda: all(c.closed.is_set() for c in clients), IDLE + 5)
        assert all(c.goaway for c in clients)
    finally:
        for client in clients:
            client.close()


def test_a_connection_that_never_calls_is_closed_when_idle(stack):
    client = HalfOpenClient(stack.target, ATTACKER)
    started = time.monotonic()
    try:
        assert client.closed.wait(IDLE + 5) and client.goaway
        took = time.monotonic() - started
        print(f"\na connection without calls closed after {took:.1f} s (--grpc-max-connection-idle {IDLE:g})")
        assert took > IDLE * 0.75  # by the idle timer (its own clock is coarse), not sooner
    finally:
        client.close()


def test_a_connection_that_never_speaks_http2_is_closed_after_the_handshake_timeout(stack):
    sock = socket.create_connection(("127.0.0.1", stack.grpc_port), source_address=(ATTACKER, 0))
    sock.settimeout(HANDSHAKE + 5)
    started = time.monotonic()
    try:
        with pytest.raises(ConnectionResetError):  # by the front: grpc never sees it
            assert sock.recv(1024) == b""
        took = time.monotonic() - started
        print(f"\na connection that sent nothing closed after {took:.1f} s "
              f"(--grpc-handshake-timeout {HANDSHAKE:g})")
        assert took > HANDSHAKE * 0.75
    finally:
        sock.close()
