"""prometheus_client's /metrics server, answering 503 while the process's loop is stalled.

The scheduler's health check (launch/healthcheck.py, compose's healthcheck, the Kubernetes
probes) is its /metrics page. prometheus_client serves that from a thread of its own, which goes
on answering 200 while the loop is wedged; this one asks the loop's heartbeat
(process_life/watchdog.py) first. Until the loop first turns it answers as prometheus_client does.
"""
from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import REGISTRY, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from process_life import watchdog

# The scheduler's loop turns at least every 0.2 s: this is a wedge, not a slow turn.
STALE_AFTER_S = 5.0


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass  # a probe every few seconds is not news


def start_metrics_server(port: int, addr: str, stale_after_s: float = STALE_AFTER_S):
    """Serves /metrics from a daemon thread; returns the server."""
    metrics = make_wsgi_app(REGISTRY)

    def app(environ, start_response):
        stalled = watchdog.stalled_for()
        if stalled > stale_after_s:
            start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
            return [f"the loop has not turned for {stalled:.1f} s\n".encode()]
        return metrics(environ, start_response)

    # An IPv6 address (--scheduler-metrics-host ::) needs its family, as in prometheus_client.
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    httpd = make_server(sockaddr[0], port, app, Server, handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    return httpd
