"""The gateway's one connection to the scheduler: a ZeroMQ DEALER speaking GatewayMessage up and
SchedulerMessage down, one protobuf per frame.

A single reader task owns the receive side and hands each TokenDelta to the queue of the request
it belongs to, so any number of concurrent RPCs share one socket without locks. Sends never wait:
a request that cannot reach the scheduler should fail now with UNAVAILABLE rather than hang, and
an abort sent from a cancellation handler must not block it.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from typing import Awaitable, Callable

import zmq
import zmq.asyncio

from proto import internal_pb2
from proto.auth import PROTOCOL_VERSION, secure_client
from proto.codec import expand_deltas

log = logging.getLogger("pagoda.gateway")

_RECONNECT_POLL = 0.05

InfoListener = Callable[["internal_pb2.ClusterInfo | None"], Awaitable[None]]


class SchedulerUnavailable(RuntimeError):
    pass


class SchedulerClient:
    def __init__(self, address: str, max_message_bytes: int = 16 << 20, *,
                 hello_interval: float = 1.0, keepalive_interval: float = 5.0,
                 lost_after: float = 20.0, keys_dir: str | None = None, model: str = ""):
        # Internal ids are f"{gateway_id}-{n}": unique across gateway replicas without coordination.
        self.gateway_id = uuid.uuid4().hex
        self.address = address
        self.max_message_bytes = max_message_bytes
        self.keys_dir = keys_dir  # CURVE keys (proto/auth.py); None: plain, for loopback tests
        self.model = model  # named in the hello: a scheduler serving another model refuses it
        self.refused = ""   # why the scheduler refused this gateway's hello, if it did
        self.hello_interval = hello_interval
        # After the first ClusterInfo a slow hello doubles as a liveness probe, and lets a
        # restarted scheduler learn this gateway's routing id again.
        self.keepalive_interval = keepalive_interval
        self.lost_after = lost_after
        self.info: internal_pb2.ClusterInfo | None = None
        self._counter = itertools.count()
        self._queues: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._listeners: list[InfoListener] = []
        self._last_heard = 0.0
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # IMMEDIATE: queue nothing while disconnected, so a send fails at once instead of
        # delivering a burst of stale requests when the scheduler comes back. No send HWM: while
        # connected, a send only fails when the scheduler is really gone.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.setsockopt(zmq.ROUTING_ID, f"gateway-{self.gateway_id}".encode())
        secure_client(sock, self.keys_dir, "gateway")
        sock.connect(self.address)
        self._sock = sock
        self._last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self._read_loop(), name="scheduler-reader"),
                       asyncio.create_task(self._hello_loop(), name="scheduler-hello")]
        for task in self._tasks:
            task.add_done_callback(_report_crash)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def add_info_listener(self, listener: InfoListener) -> None:
        self._listeners.append(listener)

    # ------------------------------------------------------------------ requests

    def new_request_id(self) -> str:
        return f"{self.gateway_id}-{next(self._counter)}"

    def open(self, request_id: str) -> asyncio.Queue:
        """Registers a request before its AddRequest goes out, so no delta can arrive unrouted."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def release(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def add(self, add: internal_pb2.AddRequest) -> None:
        if not self._send(internal_pb2.GatewayMessage(add=add)):
            raise SchedulerUnavailable(f"the scheduler at {self.address} is not connected")

    def abort(self, request_id: str, indices: tuple[int, ...] = ()) -> None:
        """Aborts the request, or only some sequences of an n > 1 request."""
        # Best effort: if the scheduler is gone, so are the blocks this abort would free.
        if not self._send(internal_pb2.GatewayMessage(abort=internal_pb2.AbortRequest(
                request_id=request_id, indices=indices))):
            log.warning("abort of %s not delivered: scheduler not connected", request_id)

    async def call(self, call: internal_pb2.Call, timeout: float = 10.0) -> internal_pb2.CallReply:
        """Asks the scheduler and waits for its answer (Abort by public id, GetLoads)."""
        call.call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call.call_id] = future
        try:
            if not self._send(internal_pb2.GatewayMessage(call=call)):
                raise SchedulerUnavailable(f"the scheduler at {self.address} is not connected")
            try:
                return await asyncio.wait_for(future, timeout)
            except asyncio.TimeoutError:
                raise SchedulerUnavailable(
                    f"the scheduler did not answer within {timeout:g} s") from None
        finally:
            self._calls.pop(call.call_id, None)

    def _send(self, msg: internal_pb2.GatewayMessage) -> bool:
        if self._sock is None:
            return False
        future = self._sock.send(msg.SerializeToString(), zmq.NOBLOCK)
        # With NOBLOCK the send completes (or fails with Again) before this returns.
        return future.done() and future.exception() is None

    # ------------------------------------------------------------------ background tasks

    async def _read_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            self._last_heard = time.monotonic()
            msg = internal_pb2.SchedulerMessage()
            try:
                # The payload is the last frame; tolerate an empty delimiter frame before it.
                msg.ParseFromString(frames[-1].bytes)
                deltas = expand_deltas(msg)  # checks that the token columns line up
            except Exception:  # noqa: BLE001 - one bad frame must not stop the gateway
                log.exception("dropped a malformed SchedulerMessage (%d frames)", len(frames))
                continue
            # Logprobs first: they describe tokens of this message or of earlier ones.
            for item in (*msg.logprobs, *deltas):
                queue = self._queues.get(item.request_id)
                if queue is not None:  # else: a request already answered or cancelled
                    queue.put_nowait(item)
            for reply in msg.replies:
                future = self._calls.get(reply.call_id)
                if future is not None and not future.done():
                    future.set_result(reply)
            if msg.refused and msg.refused != self.refused:
                log.error("the scheduler refused this gateway: %s", msg.refused)
            self.refused = msg.refused
            if msg.HasField("info"):
                if msg.info.protocol_version != PROTOCOL_VERSION:
                    self.refused = (f"the scheduler speaks protocol version "
                                    f"{msg.info.protocol_version}, this gateway {PROTOCOL_VERSION}")
                    log.error("ignoring the scheduler: %s", self.refused)
                    continue
                await self._set_info(msg.info)

    async def _set_info(self, info: internal_pb2.ClusterInfo | None) -> None:
        changed = info != self.info
        self.info = info
        if changed:
            log.info("cluster: %s", "scheduler lost" if info is None else
                     f"{info.num_workers} workers, model {info.model!r}, "
                     f"max_model_len {info.max_model_len}")
        for listener in self._listeners:
            try:
                await listener(info)
            except Exception:  # noqa: BLE001
                log.exception("ClusterInfo listener failed")

    async def _hello_loop(self) -> None:
        hello = internal_pb2.GatewayMessage(hello=internal_pb2.GatewayHello(
            protocol_version=PROTOCOL_VERSION, model=self.model))
        while True:
            if not self._send(hello):
                # Not connected yet (IMMEDIATE drops the message): retry soon, so the first
                # hello goes out as soon as the connection is up rather than a second later.
                await asyncio.sleep(_RECONNECT_POLL)
                continue
            await asyncio.sleep(self.hello_interval if self.info is None else self.keepalive_interval)
            if self.info is not None and time.monotonic() - self._last_heard > self.lost_after:
                await self._lose_scheduler()

    async def _lose_scheduler(self) -> None:
        """The scheduler stopped answering: its requests are gone with it, so fail them now
        (UNAVAILABLE) instead of letting clients wait for tokens that will never come."""
        log.error("no message from the scheduler for %.0f s", time.monotonic() - self._last_heard)
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(internal_pb2.TokenDelta(
                request_id=request_id, finish=internal_pb2.ERROR,
                error=internal_pb2.Error(code="UNAVAILABLE", message="lost contact with the scheduler")))
        await self._set_info(None)


def _report_crash(task: asyncio.Task) -> None:
    # These tasks run for the gateway's whole life; one that ends on an error leaves every
    # request hanging, so at least say so loudly.
    if not task.cancelled() and task.exception() is not None:
        log.critical("%s stopped", task.get_name(), exc_info=task.exception())
