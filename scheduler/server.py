"""The scheduler process: two ZeroMQ ROUTER sockets around the Router.

Gateways connect to one (AddRequest/AbortRequest up, TokenDeltas down), workers to the other
(hello/results up, plans down). Every frame is one protobuf message. The loop is synchronous:
a plan goes to a worker the moment its previous result is back.
"""
from __future__ import annotations

import logging
import signal
import time

import zmq

from proto import internal_pb2 as pb
from proto.polling import poll, resolve_busy_poll_us
from scheduler.router import Rejected, Router, RouterConfig

log = logging.getLogger("pagoda.scheduler")

REREGISTER_EVERY_S = 5.0


class SchedulerServer:
    def __init__(self, args) -> None:
        self.args = args
        self.router = Router(RouterConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            max_plans_in_flight=2 if args.async_scheduling else 1,
            max_waiting_requests=args.max_waiting_requests))
        self.ctx = zmq.Context()
        self.gateways = self._bind(args.scheduler_gateway_address)
        self.workers = self._bind(args.scheduler_worker_address)
        self.known_gateways: set[bytes] = set()
        # Unknown workers asked to say hello, and when: once per REREGISTER_EVERY_S, or each
        # result of a backlog would bring one more hello, and each hello a new registration.
        self.asked_hello: dict[bytes, float] = {}
        self.busy_poll_us = resolve_busy_poll_us(args.busy_poll_us)
        self.running = True

    def _bind(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.args.max_message_bytes)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer raises instead of dropping silently
        sock.bind(address)
        return sock

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.gateways, zmq.POLLIN)
        poller.register(self.workers, zmq.POLLIN)
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        log.info("scheduler up: gateways %s, workers %s", self.args.scheduler_gateway_address,
                 self.args.scheduler_worker_address)
        last_check = time.monotonic()
        while self.running:
            # A result is due when a worker is busy: spin for it rather than sleep.
            busy = any(w.scheduler.in_flight for w in self.router.workers.values())
            events = dict(poll(poller, 200, self.busy_poll_us if busy else 0))
            if self.gateways in events:
                self._drain(self.gateways, self._on_gateway)
            if self.workers in events:
                self._drain(self.workers, self._on_worker)
            now = time.monotonic()
            if now - last_check > 0.5:
                self._check_workers(now)
                last_check = now
            self._send_plans()
            self._flush_deltas()
        self._shutdown()

    def stop(self) -> None:
        self.running = False

    @staticmethod
    def _drain(sock: zmq.Socket, handle) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                log.warning("dropping a malformed message of %d frames", len(frames))
                continue
            handle(frames[0], frames[1])

    # -- gateways -----------------------------------------------------------------------------
    def _on_gateway(self, ident: bytes, data: bytes) -> None:
        msg = pb.GatewayMessage()
        try:
            msg.ParseFromString(data)
        except Exception:  # noqa: BLE001 - a bad frame must not stop the scheduler
            log.warning("unparseable gateway message from %r", ident)
            return
        self.known_gateways.add(ident)
        kind = msg.WhichOneof("kind")
        if kind == "add":
            try:
                self.router.add(ident, msg.add)
            except Rejected as e:
                self._send(self.gateways, ident, pb.SchedulerMessage(deltas=[pb.TokenDelta(
                    request_id=msg.add.request_id, finish=pb.ERROR,
                    error=pb.Error(code=e.code, message=e.message))]))
        elif kind == "abort":
            self.router.abort(msg.abort.request_id, set(msg.abort.indices))
        elif kind == "hello":
            self._send(self.gateways, ident, pb.SchedulerMessage(info=self.router.cluster_info()))
        elif kind == "call":
            # Answered after this iteration's deltas, so an aborted stream's ABORT reaches its
            # gateway no later than the answer.
            reply = self.router.call(msg.call)
            self._flush_deltas()
            self._send(self.gateways, ident, pb.SchedulerMessage(replies=[reply]))

    def _broadcast_info(self) -> None:
        info = self.router.cluster_info()
        for ident in list(self.known_gateways):
            self._send(self.gateways, ident, pb.SchedulerMessage(info=info))

    def _flush_deltas(self) -> None:
        for ident, msg in self.router.take_outbox().items():
            self._send(self.gateways, ident, msg)

    # -- workers ------------------------------------------------------------------------------
    def _on_worker(self, ident: bytes, data: bytes) -> None:
        msg = pb.WorkerMessage()
        try:
            msg.ParseFromString(data)
        except Exception:  # noqa: BLE001
            log.warning("unparseable worker message from %r", ident)
            return
        kind = msg.WhichOneof("kind")
        state = self.router.workers.get(ident)
        if state is not None:
            state.last_seen = time.monotonic()
        if kind == "hello":
            self.asked_hello.pop(ident, None)
        if kind == "goodbye":
            # A worker stopping after its step: its sequences go elsewhere now, not at a timeout.
            if state is not None:
                self.router.remove(ident, "said goodbye")
                self._broadcast_info()
        elif kind == "hello":
            why = self.router.refusal(ident, msg.hello)
            if why is not None:
                log.error("refused worker %s: %s", msg.hello.worker_id, why)
                self._send(self.workers, ident, pb.SchedulerToWorker(refused=why))
                return
            self.router.register(ident, msg.hello)
            self._broadcast_info()
        elif state is None:
            # A worker from before a scheduler restart, or one dropped: have it register again.
            now = time.monotonic()
            if now - self.asked_hello.get(ident, -REREGISTER_EVERY_S) >= REREGISTER_EVERY_S:
                self.asked_hello[ident] = now
                self._send(self.workers, ident, pb.SchedulerToWorker(reregister=True))
        elif kind == "result":
            self.router.on_result(ident, msg.result)

    def _check_workers(self, now: float) -> None:
        dead = [w for w, s in self.router.workers.items()
                if now - s.last_seen > self.args.worker_timeout]
        for ident in dead:
            self.router.remove(ident, f"silent for {self.args.worker_timeout:.0f}s")
        if dead:
            self._broadcast_info()
        self.asked_hello = {w: t for w, t in self.asked_hello.items() if now - t < 60}

    def _send_plans(self) -> None:
        # Again until no worker takes one more: a worker with no plan out gets the plan after
        # too, so the pipeline fills at once rather than one result later.
        while plans := self.router.plans():
            for ident, plan in plans:
                if not self._send(self.workers, ident, pb.SchedulerToWorker(plan=plan)):
                    self.router.remove(ident, "unreachable")
                    self._broadcast_info()

    # -- plumbing -----------------------------------------------------------------------------
    def _send(self, sock: zmq.Socket, ident: bytes, msg) -> bool:
        try:
            sock.send_multipart([ident, msg.SerializeToString()], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if sock is self.gateways:
                self.known_gateways.discard(ident)
            log.warning("cannot reach %r: %s", ident, e)
            return False

    def _shutdown(self) -> None:
        # Workers are left running: they register again with the next scheduler.
        self.gateways.close(0)
        self.workers.close(0)
        self.ctx.term()
        log.info("scheduler stopped")
