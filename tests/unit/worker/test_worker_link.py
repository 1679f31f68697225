"""The worker's main link at exit (worker/main.py Link.finish) over real ZeroMQ sockets: with the
scheduler there, the goodbye is delivered (the socket lingers for it); with the scheduler gone,
the link closes without lingering, so a stack stopped in order (scheduler before workers) does
not wait a second per worker for a goodbye nobody can take."""
from __future__ import annotations

import time

import zmq

from worker.main import Link


def _link_to(ctx: zmq.Context, port: int) -> tuple[Link, list[int]]:
    def open_socket() -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port}")
        return sock
    link, lingers = Link(open_socket), []
    close = link.close
    link.close = lambda linger: (lingers.append(linger), close(linger))[1]
    return link, lingers


def test_a_goodbye_is_delivered_while_the_scheduler_is_there():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    link, lingers = _link_to(ctx, port)
    link.sock.send(b"hello")
    assert router.poll(5000) and router.recv_multipart()[-1] == b"hello"
    link.sock.send(b"goodbye")
    link.finish()
    assert lingers == [1000]
    assert router.poll(5000) and router.recv_multipart()[-1] == b"goodbye"
    router.close(0)
    ctx.term()


def test_a_link_whose_scheduler_is_gone_closes_without_lingering():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    link, lingers = _link_to(ctx, port)
    link.sock.send(b"hello")
    assert router.poll(5000) and router.recv_multipart()[-1] == b"hello"
    router.close(0)
    deadline = time.monotonic() + 10
    while link.connected() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not link.connected()
    link.sock.send(b"goodbye")  # queued: nobody will take it
    link.finish()
    assert lingers == [0]
    ctx.term()
