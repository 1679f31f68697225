"""The worker's heartbeats, sent from a thread with a ZeroMQ socket of its own.

A forward can take longer than the scheduler waits before it declares a worker dead; the main
loop cannot heartbeat while it runs one. ZeroMQ sockets are not thread-safe, so the thread has
its own DEALER and names the main socket (by routing id) in each heartbeat. torch releases the
GIL inside its kernels, so the thread keeps its beat during a forward.
"""
from __future__ import annotations

import contextlib
import secrets
import threading

import zmq

from proto import internal_pb2
from proto.auth import secure_client

INTERVAL_S = 0.25  # the scheduler's --worker-timeout (1.5 s by default) allows several misses


def main_routing_id(worker_id: str) -> bytes:
    """A routing id for the worker's main socket, unique per process start."""
    return f"{worker_id}-{secrets.token_hex(4)}".encode()[-255:]


@contextlib.contextmanager
def heartbeats(ctx: zmq.Context, address: str, routing_id: bytes, interval: float = INTERVAL_S,
               hwm: int = 1000, keys_dir: str | None = None):
    """Heartbeats for the main socket `routing_id` while the block runs."""
    stop = threading.Event()

    def beat() -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # drop, never queue, while no scheduler is there
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        secure_client(sock, keys_dir, "worker")  # authenticated like the main socket
        sock.connect(address)
        msg = internal_pb2.WorkerMessage(heartbeat_of=routing_id).SerializeToString()
        try:
            while not stop.wait(interval):
                try:
                    sock.send(msg, zmq.NOBLOCK)
                except zmq.Again:
                    pass
        finally:
            sock.close(0)

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join()
