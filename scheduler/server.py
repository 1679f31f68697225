"""The scheduler process: two ZeroMQ ROUTER sockets around the Router.

Gateways connect to one (AddRequest/AbortRequest up, TokenDeltas down), workers to the other
(hello/results up, plans down). Every frame is one protobuf message. The loop is synchronous:
a plan goes to a worker the moment its previous result is back.

Liveness: every gateway says hello each second and gets an answer, which is its lease: a gateway
silent for --gateway-timeout loses its requests (aborted, blocks freed). Every worker heartbeats
from a thread of its own; one silent for --worker-timeout is dropped and its sequences are
recomputed on the others. With no worker for --no-worker-timeout, requests still waiting for one
end UNAVAILABLE. Messages to a gateway carry this scheduler's epoch and a per-link sequence
number, so a gateway notices a restart or a dropped message (scheduler/links.py).

Each turn of the loop serves the workers before the gateways, and takes a bounded number of
gateway messages: a burst of adds waits in ZeroMQ and pushes back on its gateway, and never
delays a heartbeat past --worker-timeout.
"""
from __future__ import annotations

import logging
import secrets
import signal
import time

import zmq

from process_life import watchdog
from process_life.ratelog import RateLimitedLog
from proto import internal_pb2 as pb
from proto.auth import CurveServer
from proto.polling import poll, resolve_busy_poll_us
from proto.sizes import (DEFAULT_MAX_MODEL_LEN, MAX_LOGPROBS, MAX_WORKERS, largest_gateway_message,
                         largest_worker_message)
from scheduler import message_checks
from scheduler.deadlines import overdue_workers
from scheduler.links import GatewayLinks
from scheduler.outbox import split
from scheduler.router import Rejected, Router, RouterConfig

log = logging.getLogger("pagoda.scheduler")

# How often leases and heartbeats are checked: well inside the 2 s a dead worker may take.
_CHECK_INTERVAL = 0.1
# A worker that was asked to say hello again is asked again only after this long.
_REREGISTER_AGAIN_S = 3.0
# The most messages handled from each socket in one turn of the loop. Workers go first, and a
# burst from the gateways waits in ZeroMQ (whose high-water mark then pushes back on them), so
# that no flood of adds delays a worker's heartbeat or result by more than one short turn: 256
# adds take a few milliseconds, even when each is refused.
_WORKER_BATCH = 4096
_GATEWAY_BATCH = 256


class SchedulerServer:
    def __init__(self, args) -> None:
        self.args = args
        self.max_model_len = args.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.router = Router(RouterConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            max_plans_in_flight=2 if args.async_scheduling else 1,
            max_waiting_requests=args.max_waiting_requests,
            max_step_failures=args.max_step_failures,
            max_seqs_per_tenant=args.max_seqs_per_tenant))
        self.ctx = zmq.Context()
        self.curve = CurveServer(self.ctx, args.zmq_keys_dir)
        # Each socket accepts the keys of its own role only (proto/auth.py), and the largest
        # valid message of its peers, nothing much larger.
        self.gateways = self._bind(args.scheduler_gateway_address, "gateway", args.max_message_bytes
                                   or largest_gateway_message(self.max_model_len))
        self.workers = self._bind(args.scheduler_worker_address, "worker", args.max_message_bytes
                                  or largest_worker_message(args.max_num_seqs,
                                                            args.max_num_batched_tokens,
                                                            MAX_LOGPROBS))
        self.epoch = secrets.randbits(63) + 1
        self.gateway_seen: dict[bytes, float] = {}  # the gateways' leases: last message
        self.links = GatewayLinks(self.epoch, self.gateway_seen)  # each link's numbering
        # A flood of bad or unanswerable messages is counted, not logged once each.
        self.unreachable = RateLimitedLog(log)
        self.dropped = RateLimitedLog(log)
        self.no_workers_since: float | None = time.monotonic()
        self.reregister_asked: dict[bytes, float] = {}
        self.refused_gateways: set[bytes] = set()  # until a hello of theirs is accepted
        self.busy_poll_us = resolve_busy_poll_us(args.busy_poll_us)
        self.poller = zmq.Poller()
        self.poller.register(self.gateways, zmq.POLLIN)
        self.poller.register(self.workers, zmq.POLLIN)
        self.last_check = time.monotonic()
        self.running = True

    def _bind(self, address: str, role: str, max_bytes: int) -> zmq.Socket:
        log.info("largest message accepted on %s: %d bytes", address, max_bytes)
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        # Past the high-water mark a send fails (ROUTER_MANDATORY) and is dropped: a gateway
        # sees the gap in its sequence numbers, a worker is dropped as unreachable.
        sock.setsockopt(zmq.SNDHWM, self.args.zmq_hwm)
        sock.setsockopt(zmq.RCVHWM, self.args.zmq_hwm)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer raises instead of dropping silently
        self.curve.secure(sock, role)
        sock.bind(address)
        return sock

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        log.info("scheduler up: gateways %s, workers %s", self.args.scheduler_gateway_address,
                 self.args.scheduler_worker_address)
        while self.running:
            watchdog.tick()  # a loop that stops turning is a hang (process_life/watchdog.py)
            self.turn()
        self._shutdown()

    def turn(self, timeout_ms: int = 200) -> None:
        """One turn of the loop: what came in, the checks, the plans and deltas that follow."""
        # A result is due when a worker is busy: spin for it rather than sleep.
        busy = any(w.scheduler.in_flight for w in self.router.workers.values())
        events = dict(poll(self.poller, timeout_ms, self.busy_poll_us if busy else 0))
        # Heartbeats and results first, then at once the check of what they renewed, so that
        # time spent on gateway traffic never counts against a worker.
        if self.workers in events:
            self._drain(self.workers, self._on_worker, _WORKER_BATCH)
        now = time.monotonic()
        if now - self.last_check > _CHECK_INTERVAL:
            self._check_workers(now)
            self._check_gateways(now)
            self.last_check = now
        if self.gateways in events:
            self._drain(self.gateways, self._on_gateway, _GATEWAY_BATCH)
        self._send_plans()
        self._flush_deltas()

    def stop(self) -> None:
        self.running = False

    def _drain(self, sock: zmq.Socket, handle, limit: int) -> None:
        """Up to `limit` messages; the rest wait for the next turn (the poll sees them at once)."""
        for _ in range(limit):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.dropped.warning("dropping a malformed message of %d frames", len(frames))
                continue
            try:
                handle(frames[0], frames[1])
            except Exception:  # noqa: BLE001 - what message_checks missed must not stop the loop
                log.exception("dropped a message from %r that could not be handled", frames[0][:64])

    # -- gateways -----------------------------------------------------------------------------
    def _on_gateway(self, ident: bytes, data: bytes) -> None:
        msg = pb.GatewayMessage()
        try:
            msg.ParseFromString(data)
        except Exception:  # noqa: BLE001 - a bad frame must not stop the scheduler
            self.dropped.warning("unparseable gateway message from %r", ident[:64])
            return
        kind = msg.WhichOneof("kind")
        if why := self._check_gateway(msg, kind):
            self.dropped.warning("dropped a %s message from gateway %r: %s", kind, ident[:64], why)
            if kind == "add" and not message_checks.check_request_id(msg.add.request_id):
                self.router.refuse(ident, msg.add.request_id,
                                   pb.Error(code="INVALID_ARGUMENT", message=why))
            return
        if kind == "hello":
            if why := message_checks.check_gateway_hello(msg.hello, self.router.cluster_info().model):
                # Once per gateway: it says hello again every second while refused.
                if ident not in self.refused_gateways:
                    log.error("refused gateway %r: %s", ident[:64], why)
                if len(self.refused_gateways) >= 4096:
                    self.refused_gateways.clear()  # bounded; a forgotten one is refused again
                self.refused_gateways.add(ident)
                self.gateway_seen.pop(ident, None)
                self._send(self.gateways, ident, pb.SchedulerMessage(refused=why))
                return
            self.refused_gateways.discard(ident)
        elif ident in self.refused_gateways:
            return  # an incompatible gateway's requests could mean anything
        self.gateway_seen[ident] = time.monotonic()  # its lease, renewed by every message
        if kind == "add":
            try:
                self.router.add(ident, msg.add)
            except Rejected as e:  # answered with this turn's deltas (Router.refuse)
                self.router.refuse(ident, msg.add.request_id, pb.Error(code=e.code, message=e.message))
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

    def _check_gateway(self, msg: pb.GatewayMessage, kind: str | None) -> str | None:
        if kind == "add":
            # Every worker agrees on the vocabulary (Router.refusal): the first one's will do,
            # and is cheaper than cluster_info() in a flood of adds.
            first = next(iter(self.router.workers.values()), None)
            return message_checks.check_request_id(msg.add.request_id) or message_checks.check_add(
                msg.add, first.hello.vocab_size if first is not None else 0)
        if kind == "abort":
            return message_checks.check_abort(msg.abort)
        if kind == "call":
            return message_checks.check_call(msg.call)
        return None if kind == "hello" else "no message kind"

    def _broadcast_info(self) -> None:
        info = self.router.cluster_info()
        for ident in list(self.gateway_seen):
            self._send(self.gateways, ident, pb.SchedulerMessage(info=info))

    def _check_gateways(self, now: float) -> None:
        """A gateway whose lease lapsed is gone (or cut off): its requests would run to
        max_tokens for nobody, so end them now and free their blocks."""
        for ident, seen in list(self.gateway_seen.items()):
            if now - seen <= self.args.gateway_timeout:
                continue
            n = self.router.abort_gateway(ident, pb.Error(code="UNAVAILABLE", message=(
                f"the scheduler heard nothing from this gateway for "
                f"{self.args.gateway_timeout:g} s (--gateway-timeout)")))
            log.warning("gateway %r silent for %.1f s: %d requests aborted", ident, now - seen, n)
            self._flush_deltas()  # in case it is only slow: it learns why its streams ended
            # Its link's numbering goes on should it be heard again (scheduler/links.py says
            # why that, not a new epoch): a restart at 1 would make it drop every message.
            del self.gateway_seen[ident]

    def _flush_deltas(self) -> None:
        for ident, msg in self.router.take_outbox().items():
            for part in split(msg):  # each within the gateway's message size bound
                self._send(self.gateways, ident, part)

    # -- workers ------------------------------------------------------------------------------
    def _on_worker(self, ident: bytes, data: bytes) -> None:
        msg = pb.WorkerMessage()
        try:
            msg.ParseFromString(data)
        except Exception:  # noqa: BLE001
            log.warning("unparseable worker message from %r", ident)
            return
        kind = msg.WhichOneof("kind")
        if kind == "heartbeat_of":
            # From the worker's heartbeat socket, for its main one. An unknown worker learns
            # that it must register again from its main socket (idle heartbeat or result).
            state = self.router.workers.get(msg.heartbeat_of)
            if state is not None:
                state.last_seen = time.monotonic()
            return
        state = self.router.workers.get(ident)
        if state is not None:
            state.last_seen = time.monotonic()
        if kind == "goodbye":
            # A worker stopping after its step: its sequences go elsewhere now, not at a timeout.
            if state is not None:
                self.router.remove(ident, "said goodbye")
                self._broadcast_info()
        elif kind == "hello":
            why = (message_checks.check_worker_hello(msg.hello) or self._beyond_bounds(ident, msg.hello)
                   or self.router.refusal(ident, msg.hello))
            if why is not None:
                log.error("refused worker %s: %s", msg.hello.worker_id, why)
                self._send(self.workers, ident, pb.SchedulerToWorker(refused=why))
                return
            self.router.register(ident, msg.hello)
            self.reregister_asked.pop(ident, None)
            self._broadcast_info()
        elif state is None:
            # A worker from before a scheduler restart: have it register again, once (its stale
            # results and heartbeats would otherwise each ask for another hello).
            now = time.monotonic()
            if now - self.reregister_asked.get(ident, 0.0) > _REREGISTER_AGAIN_S:
                self.reregister_asked[ident] = now
                self._send(self.workers, ident, pb.SchedulerToWorker(reregister=True))
        elif kind == "result":
            if why := message_checks.check_result(msg.result, state.hello.vocab_size):
                # Its step can never complete: start the worker afresh, recompute its sequences.
                log.error("bad result from worker %s: %s", state.hello.worker_id, why)
                self.router.remove(ident, why)
                self._broadcast_info()
                return
            self.router.on_result(ident, msg.result)
        elif kind == "compiled":
            if why := message_checks.check_compiled(msg.compiled):
                log.error("bad grammar answer from worker %s: %s", state.hello.worker_id, why)
                self.router.remove(ident, why)
                self._broadcast_info()
                return
            self.router.on_compiled(ident, msg.compiled)

    def _beyond_bounds(self, ident: bytes, hello: pb.WorkerHello) -> str | None:
        """What the message size bounds of this scheduler (and its gateways) cannot carry."""
        if hello.max_model_len > self.max_model_len:
            return (f"its max_model_len {hello.max_model_len} exceeds the scheduler's "
                    f"--max-model-len {self.max_model_len}, which sizes the largest message "
                    f"it accepts; give both the same --max-model-len")
        if ident not in self.router.workers and len(self.router.workers) >= MAX_WORKERS:
            return f"the scheduler has {MAX_WORKERS} workers already, its most"
        return None

    def _check_workers(self, now: float) -> None:
        dead = [(w, f"silent for {self.args.worker_timeout:g} s")
                for w, s in self.router.workers.items() if now - s.last_seen > self.args.worker_timeout]
        # Alive (its heartbeat thread beats) but its step never ends: just as dead to its streams.
        dead += [d for d in overdue_workers(self.router.workers, now, self.args.step_timeout)
                 if d[0] not in dict(dead)]
        for ident, why in dead:
            # Dead or hung in its running step: that counts against the step's sequences.
            self.router.remove(ident, why, step_lost=True)
        if dead:
            self._broadcast_info()
        if self.reregister_asked:
            self.reregister_asked = {w: t for w, t in self.reregister_asked.items()
                                     if now - t <= _REREGISTER_AGAIN_S}
        if self.router.workers:
            self.no_workers_since = None
            return
        if self.no_workers_since is None:
            self.no_workers_since = now
        elif now - self.no_workers_since > self.args.no_worker_timeout and self.router.pending:
            n = self.router.fail_pending("UNAVAILABLE", (
                f"no worker has been registered with the scheduler for "
                f"{self.args.no_worker_timeout:g} s (--no-worker-timeout)"))
            log.error("no worker for %.1f s: %d waiting sequences failed", now - self.no_workers_since, n)

    def _send_plans(self) -> None:
        lost: list[bytes] = []
        # Grammars first: a worker compiles them while it runs the plans.
        for ident, request in self.router.grammar_requests():
            if not self._send(self.workers, ident, pb.SchedulerToWorker(compile=request)):
                lost.append(ident)
        # Again until no worker takes one more: a worker with no plan out gets the plan after
        # too, so the pipeline fills at once rather than one result later.
        while plans := self.router.plans():
            for ident, plan in plans:
                if not self._send(self.workers, ident, pb.SchedulerToWorker(plan=plan)):
                    lost.append(ident)
        if lost:
            # A worker that said goodbye and closed is unreachable before its goodbye is read:
            # read what came in first, so that it leaves for the reason it gave.
            self._drain(self.workers, self._on_worker, _WORKER_BATCH)
            for ident in dict.fromkeys(lost):
                if ident in self.router.workers:
                    self.router.remove(ident, "unreachable")
                    self._broadcast_info()
            # Their sequences, requeued, go to the workers left in this turn, not after a poll.
            # Each pass removes the workers it could not reach, so this ends.
            self._send_plans()

    # -- plumbing -----------------------------------------------------------------------------
    def _send(self, sock: zmq.Socket, ident: bytes, msg) -> bool:
        if sock is self.gateways:
            # Numbered even if the send fails: the gap is how the gateway learns of the loss.
            self.links.number(ident, msg)
        try:
            sock.send_multipart([ident, msg.SerializeToString()], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            self.unreachable.warning("cannot reach %r: %s", ident[:64], e)
            return False

    def _shutdown(self) -> None:
        # Workers are left running: they register again with the next scheduler.
        self.gateways.close(0)
        self.workers.close(0)
        self.curve.stop()
        self.ctx.term()
        log.info("scheduler stopped")
