"""The gateway's one connection to the scheduler: a ZeroMQ DEALER speaking GatewayMessage up and
SchedulerMessage down, one protobuf per frame.

A single reader task owns the receive side and hands each update (proto/token_stream.py) to the
inbox of the request it belongs to, so any number of concurrent RPCs share one socket without
locks. Sends never wait: a request that cannot reach the scheduler should fail now with
UNAVAILABLE rather than hang, and an abort sent from a cancellation handler must not block it.

Liveness: a hello goes out every keepalive interval whether or not the last one could be sent,
and the scheduler answers each; silence for `lost_after` seconds, a new scheduler epoch (a
restart) or a gap in the link's sequence numbers fails every request in flight with UNAVAILABLE
and turns health NOT_SERVING until the scheduler answers again. The same hellos are the
gateway's lease at the scheduler, which aborts a silent gateway's requests.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
import uuid
from collections import Counter
from typing import Awaitable, Callable

import zmq
import zmq.asyncio

from gateway.scheduler_link import scheduler_checks as checks
from gateway.bounds.grpc_bounds import CONTEXT_BOUND
from gateway.scheduler_link.inbox import Inbox
from gateway.validation.limits import Limits
from process_life.ratelog import RateLimitedLog
from proto import internal_pb2
from proto.auth import PROTOCOL_VERSION, secure_client
from proto.sizes import MAX_LEN, largest_scheduler_message
from proto.token_stream import Columns, Update, updates

log = logging.getLogger("pagoda.gateway")

_RECONNECT_POLL = 0.05

InfoListener = Callable[["internal_pb2.ClusterInfo | None"], Awaitable[None]]


class SchedulerUnavailable(RuntimeError):
    pass


class SchedulerBusy(RuntimeError):
    """The scheduler holds as many sequences as it can (ClusterInfo.max_sequences), counting
    this gateway's own in flight: RESOURCE_EXHAUSTED, and the client may retry."""


class SchedulerClient:
    def __init__(self, address: str, max_message_bytes: int | None = None, *,
                 keepalive_interval: float = 1.0, lost_after: float = 3.0,
                 max_unread: int = 256, hwm: int = 1000, keys_dir: str | None = None,
                 model: str = ""):
        # The routing id's; request ids no longer carry it (new_request_id).
        self.gateway_id = uuid.uuid4().hex
        self.address = address
        # None: the largest valid message from the scheduler at the default request limits.
        self.max_message_bytes = max_message_bytes or largest_scheduler_message(
            Limits.max_logprobs, CONTEXT_BOUND)
        self.keys_dir = keys_dir  # CURVE keys (proto/auth.py); None: plain, for loopback tests
        self.model = model  # named in the hello: a scheduler serving another model refuses it
        self.refused = ""   # why the scheduler refused this gateway's hello, if it did
        # The hello is the liveness probe both ways, and lets a restarted scheduler learn this
        # gateway's routing id again.
        self.keepalive_interval = keepalive_interval
        self.lost_after = lost_after
        self.max_unread = max_unread
        self.hwm = hwm
        self.info: internal_pb2.ClusterInfo | None = None
        self._queues: dict[str, Inbox] = {}
        self._open_sequences = 0  # the sum of n over _queues: what this gateway has in flight
        self._held: Counter[str] = Counter()  # the same by tenant, of those opened with one
        self._tenant_of: dict[str, str] = {}
        self._epoch = 0  # the scheduler's, from its messages; 0 = none heard yet
        self._seq = 0    # the last message's sequence number on this link
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._listeners: list[InfoListener] = []
        self._last_heard = 0.0
        self._bad = RateLimitedLog(log)  # dropped messages: counted, logged once a second
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # IMMEDIATE: queue nothing while disconnected, so a send fails at once instead of
        # delivering a burst of stale requests when the scheduler comes back. A full send queue
        # fails the send (UNAVAILABLE for an add); a full receive queue makes the scheduler drop
        # a message, which the link's sequence numbers reveal.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
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
        """128 random bits: a request sent without an id is answered with this one, so no
        client may guess another's to abort it or to claim it first; unique across gateway
        replicas without coordination as a uuid4 is (the scheduler refuses a duplicate)."""
        while (request_id := secrets.token_hex(16)) in self._queues:
            pass
        return request_id

    def open(self, request_id: str, n: int = 1, tenant: str | None = None) -> Inbox:
        """Registers a request of n sequences before its AddRequest goes out, so no delta can
        arrive unrouted. tenant: whose it is (has_room)."""
        if not self.has_room(n, tenant):
            limit = self.info.max_sequences if self.info is not None else 0
            raise SchedulerBusy(
                f"the scheduler is full: this gateway has {self._open_sequences} sequences in "
                f"flight and the scheduler holds at most {limit} (waiting plus running); retry "
                "later")
        inbox = Inbox(request_id, self.max_unread, n)
        self._queues[request_id] = inbox
        self._open_sequences += n
        if tenant is not None:
            self._tenant_of[request_id] = tenant
            self._held[tenant] += n
        return inbox

    def has_room(self, n: int = 1, tenant: str | None = None) -> bool:
        """Whether n more sequences fit what the scheduler holds. Past that, a tenant holding
        fewer than another may still send (up to twice the bound in all): the scheduler gives it
        the place of that one's newest waiting request (scheduler/admission.py push_out)."""
        limit = self.info.max_sequences if self.info is not None else 0
        if not limit or self._open_sequences + n <= limit:
            return True
        if tenant is None or self._open_sequences + n > 2 * limit:
            return False
        most = max((held for t, held in self._held.items() if t != tenant), default=0)
        return self._held[tenant] + n <= most - n

    def release(self, request_id: str) -> None:
        inbox = self._queues.pop(request_id, None)
        if inbox is not None:
            self._open_sequences -= inbox.n
        tenant = self._tenant_of.pop(request_id, None)
        if tenant is not None and inbox is not None:
            self._held[tenant] -= inbox.n
            if not self._held[tenant]:
                del self._held[tenant]

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
            msg = internal_pb2.SchedulerMessage()
            try:
                # The payload is the last frame; tolerate an empty delimiter frame before it.
                msg.ParseFromString(frames[-1].bytes)
            except Exception:  # noqa: BLE001 - one bad frame must not stop the gateway
                self._bad.warning("dropped an unparseable SchedulerMessage (%d frames)", len(frames))
                continue
            if why := checks.check_envelope(msg):
                # Unnumbered as far as this gateway can tell: the link's numbering goes on. A
                # scheduler of another version may number nothing: its refusal still counts.
                foreign = msg.HasField("info") and msg.info.protocol_version != PROTOCOL_VERSION
                if not ((msg.refused or foreign) and self._take_refusal(msg)):
                    self._bad.warning("dropped a malformed SchedulerMessage: %s", why)
                continue
            if msg.epoch == self._epoch and msg.seq <= self._seq:
                self._bad.warning("dropped a repeated SchedulerMessage (seq %d, last %d)",
                                  msg.seq, self._seq)
                continue
            # Only a message taken counts as hearing the scheduler: one whose every message is
            # dropped (say, as repeated) must be declared lost, and health NOT_SERVING.
            self._last_heard = time.monotonic()
            self._check_sequence(msg)
            self._deliver(msg)
            for reply in msg.replies:
                future = self._calls.get(reply.call_id)
                if future is not None and not future.done():
                    if why := checks.check_reply(reply):
                        self._bad.warning("malformed reply to call %d: %s", reply.call_id, why)
                        future.set_exception(SchedulerUnavailable(
                            f"the scheduler sent a malformed reply: {why}"))
                    else:
                        future.set_result(reply)
            if self._take_refusal(msg):
                continue
            if msg.HasField("info"):
                await self._set_info(msg.info)
            # A ready message completes the next recv without a suspension: yield anyway, so
            # the RPCs read their inboxes between messages instead of only after a burst.
            await asyncio.sleep(0)

    def _take_refusal(self, msg: internal_pb2.SchedulerMessage) -> bool:
        """Records why the scheduler refused this gateway, or that it speaks another protocol
        version (its info is then not believed); True if msg was either."""
        if msg.HasField("info") and msg.info.protocol_version != PROTOCOL_VERSION:
            self.refused = (f"the scheduler speaks protocol version "
                            f"{msg.info.protocol_version}, this gateway {PROTOCOL_VERSION}")
            log.error("ignoring the scheduler: %s", self.refused)
            return True
        if len(msg.refused.encode()) > checks.MAX_TEXT:
            return False
        if msg.refused and msg.refused != self.refused:
            log.error("the scheduler refused this gateway: %s", msg.refused)
        self.refused = msg.refused
        return bool(msg.refused)

    def _deliver(self, msg: internal_pb2.SchedulerMessage) -> None:
        """Each update and logprobs entry to its request's inbox; one that fails its checks ends
        its own stream with INTERNAL (and is aborted), and disturbs no other. The token columns
        are checked as arrays, in a few passes for the whole message."""
        vocab = self.info.vocab_size if self.info is not None else 0
        max_len = (self.info.max_model_len if self.info is not None else 0) or MAX_LEN
        try:
            columns = Columns(msg)
            bad = checks.check_columns(columns, vocab, max_len)
            news = updates(msg, columns, bad)
            failed: dict[str, str] = {}
            for i in sorted(bad):  # each stream once, for its first bad entry
                failed.setdefault(columns.request_ids[i], bad[i])
        except ValueError as e:  # the columns do not line up: no entry in them can be trusted
            news = [Update.of_news(d) for d in msg.deltas]
            failed = dict.fromkeys(msg.request_ids, str(e))
        for rid, why in failed.items():
            self._malformed(rid, why)
        # Logprobs first: they describe tokens of this message or of earlier ones.
        for item in (*msg.logprobs, *news):
            inbox = self._queues.get(item.request_id)
            if inbox is None or inbox.closed:
                continue  # a request already answered or cancelled: late news is normal
            check = checks.check_update if isinstance(item, Update) else checks.check_logprobs
            if why := check(item, inbox.n, vocab, max_len):
                self._malformed(item.request_id, why)
            elif not inbox.put(item):
                self.abort(item.request_id)

    def _malformed(self, request_id: str, why: str) -> None:
        inbox = self._queues.get(request_id)
        self._bad.warning("malformed update from the scheduler for %s: %s",
                          request_id[:80] if inbox is not None else "an unknown request", why)
        if inbox is not None and not inbox.closed:
            inbox.fail("INTERNAL", f"the scheduler sent a malformed update for this request "
                                   f"({why[:200]})")
            self.abort(request_id)

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

    def _check_sequence(self, msg: internal_pb2.SchedulerMessage) -> None:
        """A new epoch (the scheduler restarted) or a gap in the link's numbering (a message was
        dropped on the way) loses requests in flight: fail them rather than let them hang."""
        if msg.epoch != self._epoch:
            if self._epoch:
                self._fail_all("the scheduler restarted and lost the requests in flight")
            self._epoch = msg.epoch
        elif msg.seq != self._seq + 1:  # a repeat was dropped before this
            self._fail_all(f"{msg.seq - self._seq - 1} messages from the scheduler were lost")
        self._seq = msg.seq

    def _fail_all(self, message: str) -> None:
        if self._queues:
            log.error("failing %d requests in flight: %s", len(self._queues), message)
        for inbox in list(self._queues.values()):
            inbox.fail("UNAVAILABLE", message)

    async def _hello_loop(self) -> None:
        hello = internal_pb2.GatewayMessage(hello=internal_pb2.GatewayHello(
            protocol_version=PROTOCOL_VERSION, model=self.model))
        while True:
            # A failed send (IMMEDIATE: not connected) retries soon, so the first hello goes out
            # as soon as the connection is up; either way the silence check below runs.
            sent = self._send(hello)
            await asyncio.sleep(self.keepalive_interval if sent else _RECONNECT_POLL)
            silent = time.monotonic() - self._last_heard
            if self.info is not None and silent > self.lost_after:
                log.error("no message from the scheduler for %.1f s", silent)
                self._fail_all(f"lost contact with the scheduler (silent for {silent:.1f} s)")
                # Nothing is in flight any more, so whatever numbering the scheduler speaks next
                # is taken as the link's new start: the link recovers by itself.
                self._seq = 0
                await self._set_info(None)


def _report_crash(task: asyncio.Task) -> None:
    # These tasks run for the gateway's whole life; one that ends on an error leaves every
    # request hanging, so at least say so loudly.
    if not task.cancelled() and task.exception() is not None:
        log.critical("%s stopped", task.get_name(), exc_info=task.exception())
