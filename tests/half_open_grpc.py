"""A minimal HTTP/2 client that opens gRPC calls and never sends their messages, from a local
address of the test's choosing (grpc's own client cannot bind one): a hostile client's half-open
calls. It answers the server's SETTINGS and PINGs and records, per stream, when it ended and the
grpc-status it ended with (HPACK decoded as far as a gRPC server's trailers need: indexed and
literal fields with plain strings; a Huffman-coded string is kept as None).
"""
from __future__ import annotations

import socket
import struct
import threading
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
# RFC 7541 appendix A: the static table's names (values do not matter for trailers).
_STATIC = [None, ":authority", ":method", ":method", ":path", ":path", ":scheme", ":scheme",
           ":status", ":status", ":status", ":status", ":status", ":status", ":status",
           "accept-charset", "accept-encoding", "accept-language", "accept-ranges", "accept",
           "access-control-allow-origin", "age", "allow", "authorization", "cache-control",
           "content-disposition", "content-encoding", "content-language", "content-length",
           "content-location", "content-range", "content-type", "cookie", "date", "etag",
           "expect", "expires", "from", "host", "if-match", "if-modified-since", "if-none-match",
           "if-range", "if-unmodified-since", "last-modified", "link", "location",
           "max-forwards", "proxy-authenticate", "proxy-authorization", "range", "referer",
           "refresh", "retry-after", "server", "set-cookie", "strict-transport-security",
           "transfer-encoding", "user-agent", "vary", "via", "www-authenticate"]


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    """A literal field without indexing, new name, plain strings (each under 127 bytes)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + bytes((len(n),)) + n + bytes((len(v),)) + v


class _Hpack:
    def __init__(self) -> None:
        self.table: list[tuple[str | None, str | None]] = []  # newest first

    def _int(self, data: bytes, i: int, bits: int) -> tuple[int, int]:
        mask = (1 << bits) - 1
        value = data[i] & mask
        i += 1
        if value < mask:
            return value, i
        shift = 0
        while True:
            b = data[i]
            i += 1
            value += (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value, i

    def _str(self, data: bytes, i: int) -> tuple[str | None, int]:
        huffman = data[i] & 0x80
        length, i = self._int(data, i, 7)
        raw = data[i:i + length]
        return (None if huffman else raw.decode("latin-1")), i + length

    def _entry(self, index: int) -> tuple[str | None, str | None]:
        if index < len(_STATIC):
            return _STATIC[index], None
        return self.table[index - len(_STATIC)]

    def decode(self, data: bytes) -> dict[str | None, str | None]:
        out, i = {}, 0
        while i < len(data):
            b = data[i]
            if b & 0x80:                           # indexed
                index, i = self._int(data, i, 7)
                name, value = self._entry(index)
                out[name] = value
                continue
            if b & 0xE0 == 0x20:                   # dynamic table size update
                _, i = self._int(data, i, 5)
                continue
            bits = 6 if b & 0x40 else 4            # with incremental indexing, or not
            index, i = self._int(data, i, bits)
            if index:
                name = self._entry(index)[0]
            else:
                name, i = self._str(data, i)
            value, i = self._str(data, i)
            if bits == 6:
                self.table.insert(0, (name, value))
            out[name] = value
        return out


class HalfOpenClient:
    """One HTTP/2 connection from `source` to `target` ("host:port")."""

    def __init__(self, target: str, source: str) -> None:
        host, port = target.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), source_address=(source, 0))
        self.authority = target
        self.lock = threading.Lock()
        self.next_stream = 1
        self.opened: dict[int, float] = {}
        self.ended: dict[int, tuple[float, str | None, str | None]] = {}  # (time, status, message)
        self.goaway = False
        self.closed = threading.Event()
        self._hpack = _Hpack()
        self._send(PREFACE + _frame(SETTINGS, 0, 0))
        threading.Thread(target=self._read, daemon=True).start()

    def _send(self, data: bytes) -> None:
        with self.lock:
            self.sock.sendall(data)

    def open(self, path: str, metadata: tuple[tuple[str, str], ...] = ()) -> int:
        """Sends a call's headers and nothing more; returns its stream id."""
        fields = [(":method", "POST"), (":scheme", "http"), (":path", path),
                  (":authority", self.authority), ("content-type", "application/grpc"),
                  ("te", "trailers"), *metadata]
        stream = self.next_stream
        self.next_stream += 2
        self.opened[stream] = time.monotonic()
        self._send(_frame(HEADERS, END_HEADERS, stream, b"".join(_literal(n, v) for n, v in fields)))
        return stream

    def _read(self) -> None:
        buffer, block = b"", b""
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    break
                buffer += data
                while len(buffer) >= 9:
                    length = int.from_bytes(buffer[:3], "big")
                    if len(buffer) < 9 + length:
                        break
                    kind, flags = buffer[3], buffer[4]
                    stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
                    payload, buffer = buffer[9:9 + length], buffer[9 + length:]
                    if kind == SETTINGS and not flags & ACK:
                        self._send(_frame(SETTINGS, ACK, 0))
                    elif kind == PING and not flags & ACK:
                        self._send(_frame(PING, ACK, 0, payload))
                    elif kind == GOAWAY:
                        self.goaway = True
                    elif kind in (HEADERS, CONTINUATION):
                        if kind == HEADERS:
                            pad = payload[0] if flags & PADDED else 0
                            start = (1 if flags & PADDED else 0) + (5 if flags & PRIORITY else 0)
                            payload = payload[start:len(payload) - pad]
                            self._end_stream = bool(flags & END_STREAM)
                        block += payload
                        if flags & END_HEADERS:
                            fields = self._hpack.decode(block)
                            block = b""
                            if self._end_stream and stream not in self.ended:
                                self.ended[stream] = (time.monotonic(), fields.get("grpc-status"),
                                                      fields.get("grpc-message"))
                    elif kind == RST_STREAM and stream not in self.ended:
                        self.ended[stream] = (time.monotonic(), None, None)
        except OSError:
            pass
        finally:
            self.closed.set()

    def statuses(self) -> dict[str | None, int]:
        counts: dict[str | None, int] = {}
        for _, status, _ in self.ended.values():
            counts[status] = counts.get(status, 0) + 1
        return counts

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
