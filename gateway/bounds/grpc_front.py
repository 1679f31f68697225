"""The gRPC port's front: pagoda accepts the public gRPC port's connections itself, bounds them per
client address and in total, and splices each one's bytes to the grpc.aio server, which listens
only on a private loopback port.

grpc.aio bounds connections only in total (grpc.max_allowed_incoming_connections), before any
key is seen, and offers no hook per connection: one client holding ~1,100 idle sockets kept
every keyed client's new channel, and a health check from a fresh connection, out until its
handshake timeout freed them. Here, every connection counts against its address
(--max-grpc-connections-per-peer: the one past it is closed at once) and against the total
(--max-grpc-connections). When the total is full, a new connection from an address holding
fewer connections than the biggest holder takes the place of that holder's least recently
active one (an idle socket goes before a stream that carries tokens): idle sockets from one or
a few addresses can never keep a new client out, and a flood must come from as many addresses
as the total has connections to hold a share equal to a real client's.

A connection is spliced only once it has sent its first bytes (HTTP/2's preface, or the TLS
ClientHello: grpc still terminates TLS, the front copies bytes), within
--grpc-handshake-timeout; a silent one is closed and never costs the grpc server anything.

The splice runs on the gateway's own event loop, with asyncio transports: one callback and one
write per chunk read, no thread handoff (a thread with its own loop would take the same GIL,
and the handlers that answer the calls run on this loop anyway). Back-pressure both ways: when
one side's write buffer passes WRITE_BUFFER_HIGH, reading the other side pauses until it
drains, so a connection holds at most that plus one read (256 KiB) per direction. Half-close
(FIN) is passed on as a half-close, a reset as a reset, and both sockets close together.

grpc sees the front's own loopback connection, so this front owns the table from that
connection's local port to the client's address (client_host resolves a context.peer()
through it): the per-peer call bound (gateway/bounds/call_bounds.py) and the grammar check's per-client
share keep seeing the client.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import struct
import time
from collections import Counter, OrderedDict
from contextlib import suppress
from urllib.parse import unquote

from gateway import metrics
from gateway.bounds.call_bounds import peer_host
from process_life.ratelog import RateLimitedLog

log = logging.getLogger("pagoda.gateway")

WRITE_BUFFER_HIGH, WRITE_BUFFER_LOW = 256 << 10, 64 << 10
# Calls that grpc reads after their connection closed still resolve to their client for this long.
PORT_TABLE_GRACE_S = 5.0
_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


class ConnectionTable:
    """Open connections per client address and in total, each address's least recently active
    first; decides who is admitted and whose connection makes room."""

    def __init__(self, total: int, per_peer: int) -> None:
        self.total, self.per_peer = total, per_peer
        self.by_peer: dict[str, OrderedDict[object, float]] = {}  # address -> {conn: last active}
        self.host: dict[object, str] = {}

    def __len__(self) -> int:
        return len(self.host)

    def admit(self, conn: object, host: str) -> tuple[str | None, object | None]:
        """Counts `conn` from `host`: (None, the connection it evicts, or None) when admitted,
        else (the refusal's reason, None): "per_peer" or "total"."""
        held = self.by_peer.get(host)
        count = len(held) if held else 0
        if count >= self.per_peer:
            return "per_peer", None
        evicted = None
        if len(self.host) >= self.total:
            biggest = self._biggest_holder()
            if biggest is None or len(self.by_peer[biggest]) <= count:
                return "total", None
            evicted = next(iter(self.by_peer[biggest]))  # its least recently active
            self.closed(evicted)
        self.by_peer.setdefault(host, OrderedDict())[conn] = time.monotonic()
        self.host[conn] = host
        return None, evicted

    def _biggest_holder(self) -> str | None:
        """The address with the most connections; among equals, the one whose least recently
        active connection has been quiet the longest."""
        return min(self.by_peer, key=lambda h: (-len(self.by_peer[h]),
                                                next(iter(self.by_peer[h].values()))),
                   default=None)

    def touch(self, conn: object) -> None:
        held = self.by_peer.get(self.host.get(conn, ""))
        if held is not None and conn in held:
            held[conn] = time.monotonic()
            held.move_to_end(conn)

    def closed(self, conn: object) -> None:
        host = self.host.pop(conn, None)
        if host is not None:
            held = self.by_peer[host]
            del held[conn]
            if not held:
                del self.by_peer[host]

    def counts(self) -> Counter[str]:
        return Counter({host: len(held) for host, held in self.by_peer.items()})


def _reset(transport: asyncio.BaseTransport | None) -> None:
    """Closes at once with a TCP reset (SO_LINGER 0): no flush, no TIME_WAIT left behind."""
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _Side(asyncio.Protocol):
    """One socket of a splice; what it reads goes to the other."""

    def __init__(self, splice: "_Splice") -> None:
        self.splice = splice
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(WRITE_BUFFER_HIGH, WRITE_BUFFER_LOW)
        self.splice.made(self)

    def data_received(self, data: bytes) -> None:
        self.splice.received(self, data)

    def eof_received(self) -> bool:
        return self.splice.eof(self)

    def pause_writing(self) -> None:  # this side's buffer is full: stop reading the other
        other = self.splice.other(self)
        if other is not None and other.transport is not None:
            other.transport.pause_reading()

    def resume_writing(self) -> None:
        other = self.splice.other(self)
        if other is not None and other.transport is not None:
            other.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.splice.lost(self, exc)


class _Splice:
    """One client connection and, once it has spoken, its connection to the grpc server."""

    def __init__(self, front: "GrpcFront") -> None:
        self.front = front
        self.client = _Side(self)
        self.upstream: _Side | None = None  # connecting or connected
        self.connected = False
        self.connecting: asyncio.Task | None = None
        self.port = 0  # the upstream connection's local port: how grpc names this client
        self.host = ""
        self.pending: list[bytes] = []  # the client's first bytes, while connecting upstream
        self.eofs: set[_Side] = set()
        self.timer: asyncio.TimerHandle | None = None
        self.done = False

    def other(self, side: _Side) -> _Side | None:
        return self.upstream if side is self.client else self.client

    def made(self, side: _Side) -> None:
        if side is not self.client:
            return
        peer = side.transport.get_extra_info("peername")
        if not peer:  # reset before it was accepted
            self.done = True
            side.transport.abort()
            return
        self.host = _client_address(peer)
        refusal, evicted = self.front.table.admit(self, self.host)
        if refusal is not None:
            metrics.GRPC_CONNECTIONS_REFUSED.labels(refusal).inc()
            self.front.refused.warning("closed a new gRPC connection from %s: %s", self.host, {
                "per_peer": "it has --max-grpc-connections-per-peer open",
                "total": "--max-grpc-connections are open, and it holds as many as any "
                         "other address"}[refusal])
            self.done = True
            _reset(side.transport)
            return
        if evicted is not None:
            metrics.GRPC_CONNECTIONS_EVICTED.inc()
            evicted.close(reset=True)
        self.front.open.add(self)
        metrics.GRPC_CONNECTIONS.set(len(self.front.table))
        self.timer = asyncio.get_running_loop().call_later(
            self.front.handshake_timeout, self._silent)

    def _silent(self) -> None:
        metrics.GRPC_CONNECTIONS_REFUSED.labels("silent").inc()
        self.close(reset=True)

    def received(self, side: _Side, data: bytes) -> None:
        if self.done:
            return
        self.front.table.touch(self)
        if side is not self.client or self.connected:
            other = self.other(side).transport
            if not other.is_closing():  # else its connection_lost closes this side too
                other.write(data)
        else:  # the first bytes: hold them (and reading) until grpc's connection is up
            self.pending.append(data)
            side.transport.pause_reading()
            if self.upstream is None:
                self.timer.cancel()
                self.upstream = _Side(self)
                self.connecting = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.create_connection(lambda: self.upstream, "127.0.0.1",
                                         self.front.upstream_port)
        except OSError as e:
            log.warning("cannot reach the gRPC server's private port %d: %s",
                        self.front.upstream_port, e)
            self.close(reset=True)
            return
        if self.done:  # the client left (or was evicted) meanwhile
            self.upstream.transport.abort()
            return
        self.connected = True
        self.port = self.upstream.transport.get_extra_info("sockname")[1]
        self.front.ports[self.port] = self
        self.upstream.transport.write(b"".join(self.pending))
        self.pending.clear()
        if self.client in self.eofs:
            self.upstream.transport.write_eof()
        else:
            self.client.transport.resume_reading()

    def eof(self, side: _Side) -> bool:
        self.eofs.add(side)
        other = self.other(side)
        if side is self.client and not self.connected:
            if self.upstream is None:  # gone before a byte: nothing to pass on
                self.close()
            return True  # else _connect passes the half-close on
        if len(self.eofs) == 2:
            self.close()
        elif not other.transport.is_closing() and other.transport.can_write_eof():
            other.transport.write_eof()
        return True  # keep writing the other way

    def lost(self, side: _Side, exc: Exception | None) -> None:
        # A reset (or any error) on one side resets the other; a close closes it after its
        # buffered bytes are written.
        self.close(reset=exc is not None)

    def close(self, reset: bool = False) -> None:
        for side in (self.client, self.upstream):
            if side is None or side.transport is None:
                continue
            if reset:
                _reset(side.transport)
            else:
                side.transport.close()
        if self.done:
            return
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
        self.front.table.closed(self)
        self.front.open.discard(self)
        metrics.GRPC_CONNECTIONS.set(len(self.front.table))
        if self.connected:
            asyncio.get_running_loop().call_later(PORT_TABLE_GRACE_S, self.front.forget,
                                                  self.port, self)


def _listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound sockets for `host` as grpc binds it: a wildcard (0.0.0.0, [::]) as one dual-stack
    IPv6 socket (IPv4 alone where the host has no IPv6), a name on each of its addresses with
    one port."""
    if host in _WILDCARDS:
        addresses = [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")]
    else:
        addresses = list(dict.fromkeys(
            (family, address[0]) for family, _, _, _, address in socket.getaddrinfo(
                host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)))
    socks: list[socket.socket] = []
    for family, address in addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, host not in _WILDCARDS)
            sock.bind((address, port))
        except OSError:
            sock.close()
            if host in _WILDCARDS and family == socket.AF_INET6:
                continue  # no IPv6 here: IPv4 alone
            for bound in socks:
                bound.close()
            raise
        port = port or sock.getsockname()[1]
        socks.append(sock)
        if host in _WILDCARDS:
            break
    return socks


def _client_address(peer) -> str:
    """The client's address; an IPv4 client of a dual-stack socket as IPv4, as grpc names it."""
    address = peer[0]
    if address.startswith("::ffff:"):
        mapped = ipaddress.ip_address(address.partition("%")[0]).ipv4_mapped
        if mapped is not None:
            return str(mapped)
    return address


class GrpcFront:
    """Listens on the public gRPC address; splices admitted connections to 127.0.0.1:upstream_port."""

    def __init__(self, host: str, port: int, max_connections: int, max_per_peer: int,
                 handshake_timeout: float) -> None:
        self.host, self.port = host, port
        self.table = ConnectionTable(max_connections, max_per_peer)
        self.handshake_timeout = handshake_timeout
        self.upstream_port = 0
        self.open: set[_Splice] = set()
        self.ports: dict[int, _Splice] = {}  # grpc's view (our local port) -> the client
        self.refused = RateLimitedLog(log, 10.0)
        self.strangers = RateLimitedLog(log, 10.0)
        self._servers: list[asyncio.AbstractServer] = []

    async def bind(self) -> int:
        """Binds the public address (not yet accepting); returns its port."""
        loop = asyncio.get_running_loop()
        for sock in _listening_sockets(self.host, self.port):
            self.port = sock.getsockname()[1]  # port 0: every address gets the first's port
            self._servers.append(await loop.create_server(
                lambda: _Splice(self).client, sock=sock, start_serving=False,
                backlog=min(max(self.table.total, 128), 4096)))
        return self.port

    async def serve(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        for server in self._servers:
            await server.start_serving()

    def stop_accepting(self) -> None:
        for server in self._servers:
            server.close()

    def close(self) -> None:
        """Resets every connection left (after grpc's drain, those that never became calls)."""
        self.stop_accepting()
        for splice in list(self.open):
            splice.close(reset=True)

    def forget(self, port: int, splice: _Splice) -> None:
        if self.ports.get(port) is splice:  # not a newer connection on the same port
            del self.ports[port]

    def client_host(self, peer: str) -> str:
        """A call's client address from its context.peer() (grpc sees this front's loopback
        connection): "ipv4:127.0.0.1:41234" -> the address that connection was spliced for."""
        local_host = peer_host(peer)
        try:
            port = int(unquote(peer).rpartition(":")[2])
        except ValueError:
            port = -1
        splice = self.ports.get(port)
        if splice is not None:
            return splice.host
        self.strangers.warning("a gRPC call came from %s, not through the front: a process on "
                               "this host connected to the private port", peer)
        return local_host
