"""uvicorn inside the gateway's event loop, next to the gRPC server (gateway/app.py), with the
time limits uvicorn lacks: it arms no timer before a request's headers are complete (a
connection that sends nothing, or one byte a minute, would be held forever) and none on a
client that stops reading a response. Both close the connection, which cancels its request and
aborts it at the scheduler."""
from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.edge import EdgeConfig
from gateway.http_server import HttpApi


class HttpServer:
    """uvicorn inside the gateway's loop; the gateway's own signal handlers stop it."""

    def __init__(self, api: HttpApi, host: str, port: int, edge: EdgeConfig = EdgeConfig(),
                 ssl: tuple[str, str] | None = None) -> None:
        protocol = type("EdgeProtocol", (_TimedProtocol,), {"edge": edge})
        tls = {"ssl_certfile": ssl[0], "ssl_keyfile": ssl[1]} if ssl else {}
        config = uvicorn.Config(api.app, host=host, port=port, loop="none", lifespan="off",
                                http=protocol, log_level="warning", access_log=False,
                                limit_concurrency=edge.max_http_connections,
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

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

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

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._disarm("_header_timer")
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request's headers get the same bound (uvicorn's keep-alive timer covers only
        # the silence before its first byte).
        if not self.transport.is_closing():
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
        super().connection_lost(exc)


class _EmbeddedUvicorn(uvicorn.Server):
    def capture_signals(self):
        return contextlib.nullcontext()  # the gateway's handlers stop both servers
