"""uvicorn inside the gateway's event loop, next to the gRPC server (gateway/app.py), with the
time limits uvicorn lacks: it arms no timer before a request's headers are complete (a
connection that sends nothing, or one byte a minute, would be held forever) and none on a
client that stops reading a response. Both close the connection, which cancels its request and
aborts it at the scheduler. And the bounds it lacks: on a request's head (bytes and headers,
431 past them) and on connections, by key and by peer (gateway/bounds/http_pools.py)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.bounds.client_auth import key_of, tenant_of_key
from gateway.bounds.edge import EdgeConfig
from gateway.rest.http_errors import HttpError
from gateway.bounds.http_pools import ConnectionPools, PoolLimits, Refusal
from gateway.rest.http_server import HttpApi


class HttpServer:
    """uvicorn inside the gateway's loop; the gateway's own signal handlers stop it."""

    def __init__(self, api: HttpApi, host: str, port: int, edge: EdgeConfig = EdgeConfig(),
                 ssl: tuple[str, str] | None = None) -> None:
        pools = ConnectionPools(PoolLimits(
            max_unauthenticated=edge.max_http_unauthenticated_connections,
            max_admitted=edge.max_http_connections, max_per_key=edge.max_http_connections_per_key,
            max_per_peer=edge.max_http_connections_per_peer, trusted_proxies=edge.trusted_proxies))
        protocol = type("EdgeProtocol", (_TimedProtocol,),
                        {"edge": edge, "pools": pools, "keys": api.api_keys})
        tls = {"ssl_certfile": ssl[0], "ssl_keyfile": ssl[1]} if ssl else {}
        # ws="none": no route speaks WebSocket, and an upgraded connection would leave the
        # protocol, its bounds and its pools (wsproto is installed, so "auto" would take it).
        config = uvicorn.Config(api.app, host=host, port=port, loop="none", lifespan="off",
                                http=protocol, ws="none", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=edge.shutdown_grace_period, **tls)
        self.server = _EmbeddedUvicorn(config)
        self.host, self.port = host, port
        self.task: asyncio.Task | None = None

    async def start(self) -> int:
        # Bound here, so that a port in use raises OSError to the gateway (uvicorn would exit).
        family, _, _, _, address = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError:
            sock.close()
            raise
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # a bind error, raised here
                raise OSError("the HTTP server stopped at start")
            await asyncio.sleep(0.01)
        return self.server.servers[0].sockets[0].getsockname()[1]

    async def stop(self, grace: float | None = None) -> None:
        """Refuses new connections, gives responses in flight `grace` seconds, cancels the rest."""
        if self.task is None:
            return
        if grace is not None:
            self.server.config.timeout_graceful_shutdown = grace
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await self.task


class _TimedProtocol(HttpToolsProtocol):
    edge: EdgeConfig
    pools: ConnectionPools
    keys: tuple[str, ...]

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()
        self._in_head = True      # the next bytes are a request's head (the parser says when not)
        self._mid_head = False    # a request has begun and its headers are not complete
        self._heads = 0           # heads completed, to see whether one completed inside a feed
        self._head_bytes = 0      # bytes of the current head taken so far
        self._line = bytearray()  # the head's last, unfinished line
        self._header_count = 0
        self._body_in_piece = 0   # body bytes the parser gave in the piece being fed
        self._lined = False       # a body's framing or trailers are being fed by lines
        self._too_large: str | None = None  # why the head is refused, set inside the parser
        self._refused = False     # 431 sent: what the client still sends is dropped
        self._stash = bytearray()  # read behind a pipelined request, not yet parsed
        if not self.pools.opened(self, self.client[0] if self.client else ""):
            self._hang_up()

    # ---------------------------------------------------------------- the connection pools

    @property
    def idle(self) -> bool:
        return (self.cycle is None or self.cycle.response_complete) and not self.pipeline

    def evict(self) -> None:
        self._hang_up()

    def _admit(self) -> Refusal | None:
        tenant: str | None = ""
        if self.keys:
            given = next((v for n, v in self.headers if n == b"authorization"), b"")
            key = key_of([("authorization", given.decode("latin-1"))], self.keys)
            tenant = tenant_of_key(key) if key else None
        forwarded = [v for n, v in self.headers if n == b"x-forwarded-for"]
        client = self.pools.client_of(self.client[0] if self.client else "", forwarded)
        return self.pools.admit(self, tenant, client)

    # ---------------------------------------------------------------- the head's bounds
    # The parser (httptools) would keep every header byte until the blank line, copying a
    # header it got in n pieces n times. Here a head gets --max-http-header-bytes (the request
    # line counts) and --max-http-headers, each checked before the bytes past it are kept, and
    # the parser is fed whole lines only, so that it copies each byte once. Trailers (headers
    # after a chunked body, which the parser keeps the same way) get the same: once a piece of
    # a body brings no body bytes, what follows is fed by lines within the same bound, until
    # body bytes come again.

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._unset_keepalive_if_required()
        if self._stash:
            self._stash += data
        else:
            self._receive(data)

    def _receive(self, data: bytes) -> None:
        pos = 0
        while pos < len(data) and not self._refused and not self.transport.is_closing():
            if self.pipeline:
                # A request waits behind the one being answered: the rest of what was read
                # waits unparsed (uvicorn parsed it all, queueing a request per 18 bytes).
                self._stash += memoryview(data)[pos:]
                return
            if self._in_head or self._lined:
                pos = self._take_lines(data, pos)
            else:
                pos = self._take_body(data, pos)

    def _take_lines(self, data: bytes, pos: int) -> int:
        stop = min(len(data), pos + self.edge.max_http_header_bytes - self._head_bytes)
        if stop == pos:
            self._too_long()
            return len(data)
        end = taken = self._head_end(data, pos, stop)
        if not end:  # the head goes on: feed its whole lines, keep the unfinished one
            end, taken = data.rfind(b"\n", pos, stop) + 1, stop
        self._head_bytes += taken - pos
        if not end:
            self._line += memoryview(data)[pos:stop]
            return stop
        piece = bytes(self._line) + data[pos:end] if self._line else memoryview(data)[pos:end]
        self._line = bytearray(memoryview(data)[end:taken])
        heads, in_body = self._heads, not self._in_head
        self._body_in_piece = 0
        self._feed(piece)
        if self._refused or self.transport.is_closing():
            return len(data)
        if self._in_head and (self._heads != heads or in_body):
            # A message ended inside the piece; a next one may have begun in it.
            self._lined = False
            self._head_bytes = len(self._line) + (len(piece) if self._mid_head else 0)
        elif not self._in_head and (self._heads != heads or self._body_in_piece):
            # A body follows (or goes on): the bytes after the last line are its.
            self._lined = False
            self._head_bytes = 0
            rest, self._line = bytes(self._line), bytearray()
            self._receive(rest)
        return taken

    def _head_end(self, data: bytes, pos: int, stop: int) -> int:
        """Just past the first empty line in data[pos:stop] (0: none), so that one piece holds
        at most one head and what follows it is parsed only once that request may start. (A
        guess is harmless: a piece that ends elsewhere is only a shorter piece.)"""
        if not self._line and data.startswith(b"\r\n", pos, stop):
            return pos + 2
        if self._line == b"\r" and data.startswith(b"\n", pos, stop):
            return pos + 1
        found = data.find(b"\n\r\n", pos, stop)
        return found + 3 if found >= 0 else 0

    def _take_body(self, data: bytes, pos: int) -> int:
        # In pieces no longer than a head may be: a request pipelined behind this body may begin
        # inside one, and is charged the whole piece.
        stop = min(len(data), pos + self.edge.max_http_header_bytes)
        self._body_in_piece = 0
        self._feed(memoryview(data)[pos:stop])
        if self._in_head:
            self._head_bytes = stop - pos if self._mid_head else 0
        elif not self._body_in_piece:  # chunk framing, or trailers: by lines from here
            self._lined = True
            self._head_bytes = stop - pos
        return stop

    def _too_long(self) -> None:
        if self._in_head:
            self._refuse_head(f"the request's headers exceed {self.edge.max_http_header_bytes} "
                              "bytes (--max-http-header-bytes)")
        else:  # trailers: the request is being answered, and there is no room for a 431
            self._refused = True
            self._hang_up()

    def _feed(self, piece) -> None:
        try:
            self.parser.feed_data(piece)
        except httptools.HttpParserUpgrade:
            # Served as plain HTTP/1.1 (an h2c client asks, and takes that), unlogged: one line
            # per request would let any client fill the log.
            pass
        except httptools.HttpParserError:
            if self._too_large is not None:
                self._refuse_head(self._too_large)
            else:  # unlogged too, as an Upgrade is
                self.send_400_response("Invalid HTTP request received.")

    def _refuse_head(self, message: str) -> None:
        """431 (RFC 6585), and the connection ends."""
        self._refused = True
        self._line = bytearray()
        if self.cycle is not None and not self.cycle.response_complete:
            # Pipelined behind a request being answered: that answer ends the connection.
            self.cycle.keep_alive = False
            self.flow.pause_reading()
            return
        body = json.dumps(HttpError(431, message, "invalid_request_error",
                                    code="request_header_fields_too_large").body()).encode()
        self.transport.write(b"".join([
            STATUS_LINE[431], b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body]))
        if self.transport.can_write_eof():
            # Closing with unread bytes would reset the connection, and the client would lose
            # the answer: read and drop what it still sends for a moment, as nginx lingers.
            self.transport.write_eof()
            self.loop.call_later(_LINGER_S, self._hang_up)
        else:
            self._hang_up()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._mid_head = True
        self._header_count = 0
        self._arm_header_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        # Trailers (after a chunked body) come here too and count with the headers.
        if self._header_count >= self.edge.max_http_headers:
            self._too_large = (f"the request has more than {self.edge.max_http_headers} "
                               "headers (--max-http-headers)")
            raise _HeadTooLarge
        self._header_count += 1
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm("_header_timer")
        self._in_head = self._mid_head = self._lined = False
        self._heads += 1
        if self._refused:
            return
        if len(self.pipeline) >= _MAX_PIPELINED:
            # Requests pipelined behind a body in one read, each a cycle kept until its turn.
            self._refused = True
            self._hang_up()
            return
        refusal = self._admit()
        if refusal is None:
            super().on_headers_complete()
            return
        app, self.app = self.app, _refusal_app(refusal)
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_body(self, body: bytes) -> None:
        self._body_in_piece += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True

    # ---------------------------------------------------------------- time

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.edge.http_header_timeout, self._hang_up)

    def _disarm(self, name: str) -> None:
        timer = getattr(self, name, None)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)

    def _hang_up(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the request that waited, if one did
        if self.transport.is_closing():
            return
        if self._stash and not self.pipeline:
            data, self._stash = bytes(self._stash), bytearray()
            self._receive(data)
        # The next request's headers get the same bound (uvicorn's keep-alive timer covers only
        # the silence before its first byte); not while one is being answered.
        if self.idle:
            self._arm_header_timer()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.edge.http_write_timeout, self._cut_off)

    def _cut_off(self) -> None:
        # abort, not close: close() would wait for the buffered response to drain, which a
        # client that reads nothing never lets happen.
        self.transport.abort()

    def resume_writing(self) -> None:
        self._disarm("_write_timer")
        super().resume_writing()

    def connection_lost(self, exc) -> None:
        self._disarm("_header_timer")
        self._disarm("_write_timer")
        self.pools.closed(self)
        super().connection_lost(exc)


class _HeadTooLarge(Exception):
    """Raised inside the parser's callback; the parser stops there."""


_LINGER_S = 1.0
_MAX_PIPELINED = 16  # requests queued behind the one being answered; more close the connection


def _refusal_app(refusal: Refusal):
    body = json.dumps(HttpError(refusal.status, refusal.message, refusal.type).body()).encode()

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": refusal.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
    return app


class _EmbeddedUvicorn(uvicorn.Server):
    def capture_signals(self):
        return contextlib.nullcontext()  # the gateway's handlers stop both servers
