"""The gRPC port's front (gateway/bounds/grpc_front.py): who gets a connection when the total is full,
and the splice itself (bytes both ways, half-close, reset, back-pressure, the client's address
as grpc sees it) against a plain TCP echo-like server standing in for grpc."""
from __future__ import annotations

import asyncio
import socket
import time

import pytest

from gateway.bounds.grpc_front import ConnectionTable, GrpcFront


# ---------------------------------------------------------------------------- the policy

def test_the_connection_past_an_addresss_bound_is_refused():
    table = ConnectionTable(total=10, per_peer=2)
    assert table.admit("a1", "10.0.0.1") == (None, None)
    assert table.admit("a2", "10.0.0.1") == (None, None)
    assert table.admit("a3", "10.0.0.1") == ("per_peer", None)
    table.closed("a1")
    assert table.admit("a3", "10.0.0.1") == (None, None)


def test_a_full_table_gives_a_newcomer_the_biggest_holders_least_recently_active():
    table = ConnectionTable(total=4, per_peer=4)
    for conn in ("a1", "a2", "a3"):
        table.admit(conn, "10.0.0.1")
    table.admit("b1", "10.0.0.2")
    table.touch("a1")  # a1 carries bytes: a2 is now the least recently active
    assert table.admit("c1", "10.0.0.3") == (None, "a2")
    assert table.counts() == {"10.0.0.1": 2, "10.0.0.2": 1, "10.0.0.3": 1}
    # Among equal holders, the one whose quietest connection has been quiet longest.
    assert table.admit("d1", "10.0.0.4") == (None, "a3")
    assert table.counts() == {"10.0.0.1": 1, "10.0.0.2": 1, "10.0.0.3": 1, "10.0.0.4": 1}
    # Everyone holds one: a newcomer holds none, fewer: it evicts.
    assert table.admit("e1", "10.0.0.5") == (None, "b1")
    # An address already holding as many as the biggest holder is refused, not evicting.
    assert table.admit("e2", "10.0.0.5") == ("total", None)
    assert len(table) == 4


def test_idle_sockets_from_a_few_addresses_never_keep_a_new_client_out():
    table = ConnectionTable(total=1024, per_peer=64)
    opened = [(f"x{i}", f"127.0.0.{2 + i % 20}") for i in range(1100)]
    outcomes = [table.admit(conn, host) for conn, host in opened]
    assert not any(refusal == "per_peer" for refusal, _ in outcomes)  # 55 each, under 64
    assert len(table) == 1024
    for n in range(50):  # fresh clients, each from an address of its own
        refusal, evicted = table.admit(f"new{n}", f"10.1.0.{n}")
        assert refusal is None and evicted is not None and table.host.get(f"new{n}")
    assert max(table.counts().values()) <= 55


def test_one_address_holds_at_most_its_bound():
    table = ConnectionTable(total=1024, per_peer=64)
    outcomes = [table.admit(f"x{i}", "127.0.0.2") for i in range(1100)]
    assert [r for r, _ in outcomes].count(None) == 64
    assert table.admit("keyed", "127.0.0.1") == (None, None)


# ---------------------------------------------------------------------------- the splice

class _Upstream(asyncio.Protocol):
    """Stands in for grpc: records what it reads, answers what it is told to."""
    def __init__(self, server: "_Server") -> None:
        self.server = server

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.append(self)
        self.received = bytearray()
        self.eof = asyncio.Event()
        self.lost = asyncio.Event()
        self.peer = transport.get_extra_info("peername")

    def data_received(self, data) -> None:
        self.received += data

    def eof_received(self):
        self.eof.set()
        return True

    def connection_lost(self, exc) -> None:
        self.lost.set()


class _Server:
    def __init__(self) -> None:
        self.connections: list[_Upstream] = []


async def _front(per_peer: int = 4, total: int = 8, timeout: float = 5.0):
    upstream = _Server()
    server = await asyncio.get_running_loop().create_server(
        lambda: _Upstream(upstream), "127.0.0.1", 0)
    front = GrpcFront("127.0.0.1", 0, total, per_peer, timeout)
    port = await front.bind()
    await front.serve(server.sockets[0].getsockname()[1])
    return front, port, upstream, server


async def _until(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def _open(port: int, source: str = "127.0.0.1"):
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def _case_bytes_go_both_ways_and_grpc_learns_the_clients_address():
    front, port, upstream, server = await _front()
    reader, writer = await _open(port, "127.0.0.3")
    await asyncio.sleep(0.1)
    assert not upstream.connections  # nothing spliced before the client speaks
    writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    await _until(lambda: upstream.connections and upstream.connections[0].received)
    conn = upstream.connections[0]
    assert bytes(conn.received) == b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    assert front.client_host(f"ipv4:127.0.0.1:{conn.peer[1]}") == "127.0.0.3"
    assert front.client_host("ipv4:127.0.0.1:1") == "127.0.0.1"  # not the front's: itself
    conn.transport.write(b"settings")
    assert await asyncio.wait_for(reader.readexactly(8), 5) == b"settings"
    # The client's half-close reaches grpc as one; grpc's answer still reaches the client.
    writer.write_eof()
    await asyncio.wait_for(conn.eof.wait(), 5)
    conn.transport.write(b"goaway")
    assert await asyncio.wait_for(reader.readexactly(6), 5) == b"goaway"
    conn.transport.write_eof()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    await _until(lambda: len(front.table) == 0 and not front.open)  # both closed
    writer.close()
    front.close()
    server.close()


async def _case_a_reset_reaches_the_other_side_as_a_reset():
    front, port, upstream, server = await _front()
    reader, writer = await _open(port)
    writer.write(b"hello")
    await _until(lambda: upstream.connections and upstream.connections[0].received)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    writer.transport.abort()
    await asyncio.wait_for(upstream.connections[0].lost.wait(), 5)
    await _until(lambda: len(front.table) == 0)
    front.close()
    server.close()


async def _case_a_client_that_reads_nothing_stops_the_front_reading_grpc():
    front, port, upstream, server = await _front()
    reader, writer = await _open(port)
    writer.write(b"x")
    await _until(lambda: upstream.connections and upstream.connections[0].received)
    conn = upstream.connections[0]
    chunk = b"y" * (1 << 20)
    for _ in range(64):  # 64 MiB offered; the client reads none of it
        conn.transport.write(chunk)
        await asyncio.sleep(0.01)
    # What grpc could not hand over stays in grpc's buffer, not in the front's.
    assert conn.transport.get_write_buffer_size() > 32 << 20
    client_side = next(iter(front.open)).client.transport
    assert client_side.get_write_buffer_size() < 1 << 20
    assert not next(iter(front.open)).upstream.transport.is_reading()
    writer.close()
    await asyncio.wait_for(conn.lost.wait(), 5)
    front.close()
    server.close()


async def _case_a_silent_connection_is_closed_after_the_handshake_timeout():
    front, port, upstream, server = await _front(timeout=0.3)
    reader, writer = await _open(port)
    started = time.monotonic()
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(), 5)
    assert 0.25 < time.monotonic() - started < 2
    assert not upstream.connections and len(front.table) == 0
    writer.close()
    front.close()
    server.close()


async def _case_a_newcomer_evicts_the_biggest_holders_idle_connection():
    front, port, upstream, server = await _front(per_peer=2, total=2)
    first = await _open(port, "127.0.0.2")
    second = await _open(port, "127.0.0.2")
    await _until(lambda: len(front.table) == 2)
    third = await _open(port, "127.0.0.2")  # at its own bound: refused
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(third[0].read(), 5)
    newcomer = await _open(port, "127.0.0.3")
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(first[0].read(), 5)  # the oldest went
    assert front.table.counts() == {"127.0.0.2": 1, "127.0.0.3": 1}
    for _, writer in (first, second, third, newcomer):
        writer.close()
    front.close()
    server.close()


def test_bytes_go_both_ways_and_grpc_learns_the_clients_address(run):
    run(_case_bytes_go_both_ways_and_grpc_learns_the_clients_address())


def test_a_reset_reaches_the_other_side_as_a_reset(run):
    run(_case_a_reset_reaches_the_other_side_as_a_reset())


def test_a_client_that_reads_nothing_stops_the_front_reading_grpc(run):
    run(_case_a_client_that_reads_nothing_stops_the_front_reading_grpc())


def test_a_silent_connection_is_closed_after_the_handshake_timeout(run):
    run(_case_a_silent_connection_is_closed_after_the_handshake_timeout())


def test_a_newcomer_evicts_the_biggest_holders_idle_connection(run):
    run(_case_a_newcomer_evicts_the_biggest_holders_idle_connection())


async def _case_a_wildcard_is_one_dual_stack_port_and_ipv4_clients_count_as_ipv4():
    front = GrpcFront("0.0.0.0", 0, 8, 4, 5.0)
    port = await front.bind()
    await front.serve(1)
    try:
        assert len(front._servers) == 1  # one port for both families, as grpc binds it
        _, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.4", 0))
        await _until(lambda: front.table.counts() == {"127.0.0.4": 1})  # not ::ffff:127.0.0.4
        writer.close()
        if socket.has_ipv6:
            _, writer6 = await asyncio.open_connection("::1", port)
            await _until(lambda: "::1" in front.table.counts())
            writer6.close()
    finally:
        front.close()


def test_a_wildcard_is_one_dual_stack_port_and_ipv4_clients_count_as_ipv4(run):
    run(_case_a_wildcard_is_one_dual_stack_port_and_ipv4_clients_count_as_ipv4())
