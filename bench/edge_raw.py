"""Raw sockets for the edge soak's hostile client (bench/edge_attacks.py): a TCP relay that
gives gRPC channels a loopback source address of their own, and HTTP/2 written by hand, so that
a gRPC call can send its headers and never its message.
"""
from __future__ import annotations

import socket
import threading
from collections import Counter

SERVICE = "/pagoda.v1.Generation/"


class Relay:
    """A TCP relay on 127.0.0.1 whose connections reach the target from `source` (grpc-python
    cannot bind a channel's local address)."""

    def __init__(self, target: tuple[str, int], source: str) -> None:
        self.target, self.source = target, source
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            try:
                upstream = socket.create_connection(self.target, source_address=(self.source, 0))
            except OSError:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# ---------------------------------------------------------------------------- raw HTTP/2

def h2_frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _hpack_int(n: int) -> bytes:  # 7-bit prefix (RFC 7541 5.1), Huffman off
    if n < 127:
        return bytes([n])
    out, n = bytearray([127]), n - 127
    while n >= 128:
        out.append(n % 128 + 128)
        n //= 128
    return bytes(out + bytes([n]))


def hpack(headers: list[tuple[str, str]]) -> bytes:
    """Literal header fields without indexing, new names (RFC 7541 6.2.2): no table to track."""
    return b"".join(b"\x00" + _hpack_int(len(k)) + k.encode() + _hpack_int(len(v)) + v.encode()
                    for k, v in headers)


class H2Conn:
    """One HTTP/2 connection that opens gRPC calls and never sends their messages, while a
    thread answers the server's SETTINGS and PINGs (so only the calls are at issue) and counts
    what it sends back."""

    def __init__(self, port: int, source: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + h2_frame(4, 0, 0))
        self.seen: Counter = Counter()
        self.lock, self.next_stream = threading.Lock(), 1
        threading.Thread(target=self._read, daemon=True).start()

    def open_calls(self, n: int, method: str) -> None:
        block = hpack([(":method", "POST"), (":scheme", "http"), (":path", SERVICE + method),
                       (":authority", "soak"), ("content-type", "application/grpc"), ("te", "trailers")])
        with self.lock:
            frames = [h2_frame(1, 4, s, block) for s in range(self.next_stream, self.next_stream + 2 * n, 2)]
            self.next_stream += 2 * n
        self.sock.sendall(b"".join(frames))

    def _read(self) -> None:
        buf = b""
        try:
            while chunk := self.sock.recv(1 << 16):
                buf += chunk
                while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                    n, kind, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
                    payload, buf = buf[9:9 + n], buf[9 + n:]
                    self.seen[{0: "DATA", 1: "HEADERS", 3: "RST_STREAM", 4: "SETTINGS", 6: "PING",
                               7: "GOAWAY", 8: "WINDOW_UPDATE"}.get(kind, f"type{kind}")] += 1
                    with self.lock:
                        if kind == 4 and not flags & 1:
                            self.sock.sendall(h2_frame(4, 1, 0))
                        elif kind == 6 and not flags & 1:
                            self.sock.sendall(h2_frame(6, 1, 0, payload))
        except OSError:
            pass
        self.seen["closed"] += 1

    def close(self) -> None:
        # shutdown first: close() alone leaves the connection open while the reader thread is
        # blocked in recv() on it
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
