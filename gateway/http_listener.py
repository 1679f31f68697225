"""uvicorn inside the gateway's event loop, next to the gRPC server (gateway/app.py)."""
from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn

from gateway.http_server import HttpApi


class HttpServer:
    """uvicorn inside the gateway's loop; the gateway's own signal handlers stop it."""

    def __init__(self, api: HttpApi, host: str, port: int) -> None:
        config = uvicorn.Config(api.app, host=host, port=port, loop="none", lifespan="off",
                                log_level="warning", access_log=False, timeout_graceful_shutdown=5)
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

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await self.task


class _EmbeddedUvicorn(uvicorn.Server):
    def capture_signals(self):
        return contextlib.nullcontext()  # the gateway's handlers stop both servers
