"""Hostile clients against the HTTP port of the real stack (scheduler, gateway, fake worker
processes), before and after authentication: heads without end or with too many headers, idle
sockets from many addresses, too many connections from one address or one key. While each
attack runs, tenant B's stream stays token-exact and HTTP /health answers within 1 s; the
gateway's RSS grows by less than 100 MB."""
from __future__ import annotations

import http.client
import select
import socket
import threading
import time

import pytest

from tests.cluster import wait_for
from tests.fake_cluster import FakeCluster, rss_bytes
from tests.faults.test_hostile_edge import KEY_A, KEY_B, MODEL, check_undisturbed, post, victim

pytestmark = pytest.mark.integration

HEADER_BYTES, HEADERS = 64 << 10, 100   # the flags' defaults
WAITING, PER_PEER, PER_KEY, ADMITTED = 24, 4, 4, 6
RSS_GROWTH = 100e6
PROXY = "127.0.7.1"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    c = FakeCluster(
        tmp_path_factory.mktemp("hostile_http"), http=True, gateway_address_space=3 << 30,
        gateway_flags=["--api-key", KEY_A, "--api-key", KEY_B, "--http-header-timeout", "5",
                       "--trusted-proxies", PROXY + "/32",
                       "--max-http-unauthenticated-connections", str(WAITING),
                       "--max-http-connections-per-peer", str(PER_PEER),
                       "--max-http-connections-per-key", str(PER_KEY),
                       "--max-http-connections", str(ADMITTED)],
        worker_flags=["--num-gpu-blocks-override", "20000", "--step-delay", "0.01"]).start()
    c.rss_at_start = rss_bytes(c.gateway.pid)
    yield c
    c.stop()


def health_took(stack) -> float:
    """Seconds a fresh connection without a key waits for HTTP /health's 200."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=1)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()
    return time.monotonic() - started


def socket_from(stack, address: str) -> socket.socket:
    """A connection to the HTTP port from `address` (any of 127/8 is this machine)."""
    sock = socket.socket()
    sock.bind((address, 0))
    sock.connect(("127.0.0.1", stack.http_port))
    return sock


def closed_by_gateway(sock: socket.socket, wait: float) -> bool:
    sock.settimeout(wait)
    try:
        return sock.recv(1) == b""
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def status_of(head: bytes) -> int:
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0


def keyed(stack, key: str, source: str = "127.0.0.1",
          forwarded_for: str | None = None) -> http.client.HTTPConnection:
    """A keep-alive connection from `source` that has made one request with `key`; its status
    is .status. (uvicorn closes it after 5 s without a request.)"""
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=5,
                                      source_address=(source, 0))
    headers = {"Authorization": f"Bearer {key}"}
    if forwarded_for:
        headers["X-Forwarded-For"] = forwarded_for
    conn.request("GET", "/v1/models", headers=headers)
    response = conn.getresponse()
    response.read()
    conn.status = response.status
    return conn


def test_endless_header_lines_get_431_without_the_gateway_keeping_them(stack):
    stream = victim(stack, 31)
    rss = rss_bytes(stack.gateway.pid)
    heads: list[bytes] = []
    sent = [0] * 8

    def flood(i: int) -> None:
        sock = socket_from(stack, f"127.0.1.{i + 1}")
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Flood: ")
        chunk = b"a" * (64 << 10)
        try:
            while not select.select([sock], [], [], 0)[0] and sent[i] < 64 << 20:
                sent[i] += sock.send(chunk)
            sock.settimeout(5)
            heads.append(sock.recv(4096))
        except OSError as e:
            heads.append(repr(e).encode())
        sock.close()

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    slowest = max(health_took(stack) for _ in range(5))
    for t in threads:
        t.join(30)
    grown = rss_bytes(stack.gateway.pid) - rss
    print(f"\n8 endless header lines: {sum(sent) >> 20} MiB sent; /health within {slowest:.3f} s; "
          f"RSS {grown / 1e6:+.1f} MB")
    assert [status_of(h) for h in heads] == [431] * 8, heads
    assert all(b"(--max-http-header-bytes)" in h for h in heads)
    assert slowest < 1.0
    assert grown < RSS_GROWTH
    check_undisturbed(stack, stream, 31)
    assert health_took(stack) < 1.0


def test_more_headers_than_the_bound_get_431(stack):
    stream = victim(stack, 32)
    def head(count: int) -> bytes:
        return (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY_A.encode()
                + b"\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(count - 2)) + b"\r\n")
    for count, status in ((HEADERS, 200), (HEADERS + 1, 431), (10_000, 431)):
        sock = socket_from(stack, "127.0.2.1")
        sock.sendall(head(count))
        sock.settimeout(5)
        answer = sock.recv(4096)
        sock.close()
        assert status_of(answer) == status, (count, answer)
    assert b"more than 100 headers (--max-http-headers)" in answer
    assert health_took(stack) < 1.0
    check_undisturbed(stack, stream, 32)


def test_idle_sockets_without_a_key_cannot_keep_a_keyed_client_out(stack):
    stream = victim(stack, 33)
    rss = rss_bytes(stack.gateway.pid)
    kept = keyed(stack, KEY_A)  # admitted before the flood: it stays so through it
    assert kept.status == 200
    idle = [socket_from(stack, f"127.0.3.{i + 1}") for i in range(2 * WAITING)]
    # Half-sent heads count as idle too (nothing is being answered on them).
    for sock in idle[::2]:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost")
    try:
        kept.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY_A}"})
        assert kept.getresponse().read() and kept.sock is not None  # never evicted
        # The first WAITING were closed to make room for the next WAITING, oldest first.
        assert [closed_by_gateway(s, 2) for s in idle[:WAITING]] == [True] * WAITING
        assert [closed_by_gateway(s, 0.05) for s in idle[WAITING:]] == [False] * WAITING
        fresh = keyed(stack, KEY_B)  # its connection closes the oldest idle one; then admitted
        assert fresh.status == 200
        assert closed_by_gateway(idle[WAITING], 2)
        assert health_took(stack) < 1.0
        status, body, _ = post(stack, "/v1/completions",
                               {"model": MODEL, "prompt": [1, 2], "max_tokens": 1})
        assert status == 200, body
        fresh.close()
    finally:
        kept.close()
        for sock in idle:
            sock.close()
    grown = rss_bytes(stack.gateway.pid) - rss
    print(f"\n{2 * WAITING} idle sockets: RSS {grown / 1e6:+.1f} MB")
    assert grown < RSS_GROWTH
    check_undisturbed(stack, stream, 33)


def test_one_address_cannot_open_more_than_its_share(stack):
    held = [socket_from(stack, "127.0.4.1") for _ in range(PER_PEER)]
    extra = socket_from(stack, "127.0.4.1")
    try:
        assert closed_by_gateway(extra, 2)
        assert not any(closed_by_gateway(s, 0.05) for s in held)
        other = socket_from(stack, "127.0.4.2")  # another address is served
        other.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        other.settimeout(5)
        assert status_of(other.recv(4096)) == 200
        other.close()
    finally:
        for sock in [*held, extra]:
            sock.close()
    assert wait_for(lambda: status_of(_health_from(stack, "127.0.4.1")) == 200, 5)


def _health_from(stack, address: str) -> bytes:
    sock = socket_from(stack, address)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(5)
    try:
        return sock.recv(4096)
    except OSError:
        return b""
    finally:
        sock.close()


def test_keyed_connections_are_bounded_per_key_and_in_total(stack):
    stream = victim(stack, 34)
    # Each from an address of its own: the per-peer bound is not what is tested here.
    conns = [keyed(stack, KEY_A, f"127.0.5.{i + 1}") for i in range(PER_KEY)]
    try:
        assert [c.status for c in conns] == [200] * PER_KEY
        over_key = keyed(stack, KEY_A, "127.0.5.100")
        assert over_key.status == 429 and over_key.sock is None  # and the gateway closed it
        conns += [keyed(stack, KEY_B, f"127.0.5.{i + 50}") for i in range(ADMITTED - PER_KEY)]
        assert [c.status for c in conns] == [200] * ADMITTED
        over_total = keyed(stack, KEY_B, "127.0.5.101")
        assert over_total.status == 503 and over_total.sock is None
        assert health_took(stack) < 1.0  # /health has no key: it never needs an admitted slot
    finally:
        for conn in conns:
            conn.close()

    def served() -> bool:
        conn = keyed(stack, KEY_B, "127.0.5.102")
        conn.close()
        return conn.status == 200
    assert wait_for(served, 5)
    check_undisturbed(stack, stream, 34)


def test_behind_a_trusted_proxy_the_bound_counts_the_forwarded_client(stack):
    # Through the proxy: the proxy's own address is not bounded, the clients it names are.
    # A client's own X-Forwarded-For entries (left of the proxy's) are not believed.
    conns = [keyed(stack, (KEY_A, KEY_B)[i % 2], PROXY, "203.0.113.1") for i in range(PER_PEER)]
    held: list[socket.socket] = []
    try:
        assert [c.status for c in conns] == [200] * PER_PEER
        over = keyed(stack, KEY_A, PROXY, "192.0.2.77, 203.0.113.1")
        assert over.status == 429 and over.sock is None  # the proxy's fifth: for the client
        # From an address that is not a proxy, X-Forwarded-For changes nothing.
        direct = [keyed(stack, KEY_B, "127.0.7.2", f"198.51.100.{i}") for i in range(2)]
        conns += direct
        assert [c.status for c in direct] == [200] * 2
        held = [socket_from(stack, "127.0.7.2") for _ in range(PER_PEER - 1)]
        assert closed_by_gateway(held[-1], 2)
        assert not any(closed_by_gateway(sock, 0.05) for sock in held[:-1])
    finally:
        for conn in [*conns, *held]:
            conn.close()


def test_a_websocket_upgrade_is_answered_as_plain_http_and_leaks_no_slot(stack):
    # An upgraded connection would leave the gateway's protocol and never be uncounted: the
    # address would be locked out after --max-http-connections-per-peer of them.
    for _ in range(PER_PEER + 2):
        sock = socket_from(stack, "127.0.8.1")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                     b"Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     b"Sec-WebSocket-Version: 13\r\n\r\n")
        sock.settimeout(5)
        assert status_of(sock.recv(4096)) == 200
        sock.close()
        time.sleep(0.05)  # the gateway sees the close
