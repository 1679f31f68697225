"""The HTTP port's bounds on a request's head, in process: bytes fed into the gateway's httptools
protocol (gateway/rest/http_listener.py) through a stand-in transport, and what its parser got."""
from __future__ import annotations

import asyncio
import json
import re

import pytest
import uvicorn
from uvicorn.server import ServerState

from gateway.bounds.client_auth import tenant_of_key
from gateway.bounds.edge import EdgeConfig
from gateway.rest.http_listener import _TimedProtocol
from gateway.bounds.http_pools import ConnectionPools, PoolLimits

LIMIT = 1024
EDGE = EdgeConfig(max_http_header_bytes=LIMIT, max_http_headers=8)


class Transport(asyncio.Transport):
    def __init__(self, peer: str = "127.0.0.1") -> None:
        super().__init__()
        self.peer, self.sent, self.closed, self.eof = peer, bytearray(), False, False

    def get_extra_info(self, name, default=None):
        return {"peername": (self.peer, 40000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data) -> None:
        self.sent += data

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Spy:
    """The protocol's parser, recording the pieces it is fed."""

    def __init__(self, parser) -> None:
        self.parser, self.pieces = parser, []

    def feed_data(self, data) -> None:
        self.pieces.append(bytes(data))
        self.parser.feed_data(data)

    def __getattr__(self, name):
        return getattr(self.parser, name)


async def ok(scope, receive, send) -> None:
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def connect(edge=EDGE, pools=None, keys=(), peer="127.0.0.1"):
    cls = type("P", (_TimedProtocol,), {"edge": edge, "keys": keys,
                                        "pools": pools or ConnectionPools()})
    config = uvicorn.Config(ok, loop="none", lifespan="off", ws="none", log_level="warning")
    config.load()
    proto = cls(config=config, server_state=ServerState(), app_state={},
                _loop=asyncio.get_running_loop())
    transport = Transport(peer)
    proto.connection_made(transport)
    proto.parser = Spy(proto.parser)
    return proto, transport


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def statuses(sent: bytearray) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", bytes(sent))]


def head_of(size: int, path: str = "/") -> bytes:
    """A GET whose head is exactly `size` bytes."""
    start = f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Pad: ".encode()
    return start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"


def test_a_head_of_the_bound_is_served_and_one_byte_more_gets_431(run):
    async def main():
        proto, transport = connect()
        proto.data_received(head_of(LIMIT))
        await settle()
        assert statuses(transport.sent) == [200] and not transport.closed
        proto.data_received(head_of(LIMIT))  # the next request on the connection: its own bound
        await settle()
        assert statuses(transport.sent) == [200, 200]
        proto, transport = connect()
        proto.data_received(head_of(LIMIT + 1))
        await settle()
        assert statuses(transport.sent) == [431] and transport.eof
        assert sum(map(len, proto.parser.pieces)) <= LIMIT
        body = json.loads(bytes(transport.sent).split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_header_fields_too_large"
        assert f"exceed {LIMIT} bytes (--max-http-header-bytes)" in body["error"]["message"]
    run(main())


def test_an_endless_header_line_is_kept_only_to_the_bound_and_never_fed_in_pieces(run):
    async def main():
        proto, transport = connect()
        proto.data_received(b"GET / HTTP/1.1\r\nX-Long: ")
        for _ in range(3 * LIMIT):  # one byte at a time: the parser would copy the line each time
            proto.data_received(b"a")
        await settle()
        assert statuses(transport.sent) == [431]
        assert proto.parser.pieces == [b"GET / HTTP/1.1\r\n"]  # the unfinished line: never fed
        assert len(proto._line) == 0  # dropped with the refusal
        assert transport.eof and not transport.closed  # lingering: reads and drops for a moment
        proto.data_received(b"more" * 1000)
        assert proto.parser.pieces == [b"GET / HTTP/1.1\r\n"]
    run(main())


def test_a_head_sent_a_byte_at_a_time_reaches_the_parser_a_line_at_a_time(run):
    async def main():
        proto, transport = connect()
        for byte in head_of(200):
            proto.data_received(bytes([byte]))
        await settle()
        assert statuses(transport.sent) == [200]
        assert len(proto.parser.pieces) == 4  # request line, Host, X-Pad, the blank line
    run(main())


def test_the_url_counts_toward_the_bound(run):
    async def main():
        proto, transport = connect()
        proto.data_received(b"GET /" + b"u" * LIMIT + b" HTTP/1.1\r\n\r\n")
        await settle()
        assert statuses(transport.sent) == [431]
    run(main())


def test_more_headers_than_the_bound_get_431(run):
    async def main():
        proto, transport = connect()
        proto.data_received(b"GET / HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(8))
                            + b"\r\n")
        await settle()
        assert statuses(transport.sent) == [200]
        proto, transport = connect()
        proto.data_received(b"GET / HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(9))
                            + b"\r\n")
        await settle()
        assert statuses(transport.sent) == [431] and proto.headers is not None
        assert len(proto.headers) == 8  # the ninth was refused before it was kept
        assert "more than 8 headers (--max-http-headers)" in transport.sent.decode()
    run(main())


def test_a_body_and_a_pipelined_request_in_the_same_bytes_are_served(run):
    async def main():
        proto, transport = connect()
        body = b'{"a":\n1}' * 300  # 2,400 bytes, more than a head may be, with line ends
        proto.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                            + body + head_of(300))
        for _ in range(3):
            await settle()
        assert statuses(transport.sent) == [200, 200] and not transport.closed
    run(main())


def test_chunk_framing_and_trailers_are_bounded_as_a_head_is(run):
    async def main():
        proto, transport = connect()
        start = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        small_chunks = b"".join(b"1\r\n%c\r\n" % (97 + i % 26) for i in range(2000))  # 12 KB
        proto.data_received(start + small_chunks + b"0\r\nX-Trailer: t\r\n\r\n")
        await settle()
        assert statuses(transport.sent) == [200] and not transport.closed
        proto, transport = connect()
        proto.data_received(start + b"3\r\nabc\r\n")
        proto.data_received(b"0\r\n")  # the last chunk: no body bytes, so lines from here
        fed = len(proto.parser.pieces)
        proto.data_received(b"X-Endless: ")
        for _ in range(4 * LIMIT // 100):  # 100 bytes at a time: never fed in pieces either
            proto.data_received(b"t" * 100)
        assert transport.closed and len(proto.parser.pieces) == fed
        proto, transport = connect()  # trailers in the bound are read
        proto.data_received(start + b"3\r\nabc\r\n")
        for byte in b"0\r\nX-T: " + b"t" * 500 + b"\r\n\r\n":
            proto.data_received(bytes([byte]))
        await settle()
        assert statuses(transport.sent) == [200] and not transport.closed
    run(main())


def test_pipelined_requests_wait_unparsed_behind_the_one_being_answered(run):
    async def main():
        proto, transport = connect()
        proto.data_received(head_of(40) * 1000)  # 40 KB: uvicorn queued 1,000 requests
        assert len(proto.pipeline) == 1 and len(proto._stash) == 40 * 998
        for _ in range(1000):
            await settle()
            if len(statuses(transport.sent)) == 1000:
                break
        assert statuses(transport.sent) == [200] * 1000 and not transport.closed
        assert len(proto._stash) == 0 and proto._header_timer is not None
    run(main())


def test_a_burst_pipelined_behind_a_body_closes_the_connection(run):
    async def main():
        proto, transport = connect()
        # In the body's piece the parser reads on past the body: 24 requests at once.
        proto.data_received(b"POST / HTTP/1.1\r\nContent-Length: 1\r\n\r\n{" + head_of(40) * 24)
        assert transport.closed and len(proto.pipeline) == 16
        proto, transport = connect()
        proto.data_received(b"POST / HTTP/1.1\r\nContent-Length: 1\r\n\r\n{" + head_of(40) * 16)
        for _ in range(100):
            await settle()
        assert statuses(transport.sent) == [200] * 17 and not transport.closed
    run(main())


def test_an_upgrade_is_served_as_plain_http_and_the_connection_stays(run):
    async def main():
        proto, transport = connect()
        for upgrade in (b"h2c", b"websocket"):
            proto.data_received(b"GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: " + upgrade
                                + b"\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                                  b"Sec-WebSocket-Version: 13\r\n\r\n")
            await settle()
        proto.data_received(head_of(100))
        await settle()
        assert statuses(transport.sent) == [200] * 3 and not transport.closed
    run(main())


def test_a_keyed_request_moves_its_connection_to_the_admitted_pool(run):
    async def main():
        pools = ConnectionPools(PoolLimits(max_unauthenticated=4))
        proto, transport = connect(pools=pools, keys=("k1",))
        assert pools.counts() == {"waiting": 1, "admitted": 0, "peers": 1}
        proto.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # no key: still waiting
        assert pools.counts()["waiting"] == 1
        proto.data_received(b"GET / HTTP/1.1\r\nAuthorization: Bearer k1\r\n\r\n")
        assert pools.counts() == {"waiting": 0, "admitted": 1, "peers": 1}
        assert pools._admitted[proto] == tenant_of_key("k1")
        await settle()
        proto.connection_lost(None)
        assert pools.counts() == {"waiting": 0, "admitted": 0, "peers": 0}
    run(main())


def test_a_refused_admission_is_answered_and_ends_the_connection(run):
    async def main():
        pools = ConnectionPools(PoolLimits(max_per_key=1))
        first, _ = connect(pools=pools, keys=("k1",))
        first.data_received(b"GET / HTTP/1.1\r\nAuthorization: Bearer k1\r\n\r\n")
        second, transport = connect(pools=pools, keys=("k1",))
        second.data_received(b"GET / HTTP/1.1\r\nAuthorization: Bearer k1\r\n\r\n")
        await settle()
        assert statuses(transport.sent) == [429] and transport.closed
        assert b"(--max-http-connections-per-key)" in transport.sent
    run(main())


@pytest.mark.parametrize("peers", [1])
def test_a_connection_past_its_peers_bound_is_closed_at_once(run, peers):
    async def main():
        pools = ConnectionPools(PoolLimits(max_per_peer=peers))
        _, kept = connect(pools=pools, peer="10.0.0.1")
        _, refused = connect(pools=pools, peer="10.0.0.1")
        _, other = connect(pools=pools, peer="10.0.0.2")
        assert (kept.closed, refused.closed, other.closed) == (False, True, False)
    run(main())
