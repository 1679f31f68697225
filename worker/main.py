"""`python -m worker.main [flags]`: one worker process, a ZeroMQ DEALER facing the scheduler.

It says hello once the model is loaded and the cache allocated, then answers every plan with a
result, and says hello again when the scheduler asks (after a restart). A thread heartbeats on a
socket of its own (worker/heartbeat.py), so a long forward never looks like a dead worker; the
main socket heartbeats too while idle, which is how a restarted scheduler finds it to ask for a
new hello. SIGTERM or SIGINT while serving finishes the current step and says goodbye, so the
scheduler requeues this worker's sequences at once. Every frame is one protobuf message.

With --tensor-parallel-size N this process is rank 0 of N (worker/parallel/ranks.py): it alone talks
to the scheduler, and leaves it with a goodbye when another rank is lost.
"""
from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from process_life import lifetime, watchdog
from process_life.flag_errors import main_refusing
from proto import internal_pb2
from proto.auth import check_auth_args, secure_client
from proto.polling import receive, resolve_busy_poll_us
from proto.sizes import largest_step_plan
from worker.heartbeat import heartbeats, main_routing_id
from worker.parallel.group_lost import GroupLost
from worker.worker_flags import add_worker_args

logger = logging.getLogger("pagoda.worker")

HEARTBEAT_S = 1.0
DRAIN_S = 5.0  # after SIGTERM, for the step in hand and the goodbye (process_life/lifetime.py)
STOP_CHECK_S = 0.2  # the longest an idle worker takes to notice SIGTERM
COMPILE_CHECK_MS = 2  # while grammars compile: how soon an idle worker says one is done
# libzmq retries a dropped connection every 100 ms by itself, except after a protocol error (an
# oversized frame), when it gives up for good: a connection down this long with no retry is
# rebuilt on a new socket.
GIVE_UP_S = 1.0
_LINK_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


class Link:
    """The main socket and a monitor on it. reopen() replaces a socket libzmq gave up on."""

    def __init__(self, open_socket) -> None:
        self.open_socket = open_socket
        self.sock = open_socket()
        self.monitor = self.sock.get_monitor_socket(_LINK_EVENTS)
        self.down_since: float | None = None
        self.up = True  # main_socket returns a connected socket

    def given_up(self) -> bool:
        """Whether the connection dropped and libzmq has not tried it again for GIVE_UP_S."""
        self._read_events()
        return self.down_since is not None and time.monotonic() - self.down_since > GIVE_UP_S

    def connected(self) -> bool:
        """Whether the connection is up, as far as the monitor's events have told."""
        self._read_events()
        return self.up

    def _read_events(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            # A retry means libzmq has not given up, not that the connection is back.
            self.down_since = time.monotonic() if event == zmq.EVENT_DISCONNECTED else None
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED):
                self.up = event == zmq.EVENT_CONNECTED

    def reopen(self) -> zmq.Socket:
        self.close(linger=0)
        self.sock = self.open_socket()
        self.monitor = self.sock.get_monitor_socket(_LINK_EVENTS)
        self.down_since, self.up = None, True
        return self.sock

    def finish(self) -> None:
        """Closes the link at exit, letting a goodbye leave if the scheduler can take it: with it
        gone (the launcher stops it before the workers) waiting would only delay the exit."""
        self.close(linger=1000 if self.connected() else 0)

    def close(self, linger: int) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(linger=linger)


def serve(runner, link: Link, busy_poll_us: float = 0.0, ranks=None) -> int:
    """The worker loop over a connected socket; returns the exit code on shutdown. ranks: the
    other ranks of a tensor-parallel worker (worker/parallel/ranks.py RankGroup), or None."""
    send = lambda msg, flags=0: link.sock.send(msg.SerializeToString(), flags)  # noqa: E731

    def goodbye() -> None:
        try:
            send(internal_pb2.WorkerMessage(goodbye=True), zmq.NOBLOCK)
        except zmq.Again:
            pass  # no scheduler connected: nobody to tell

    stop: list[int] = []
    if threading.current_thread() is threading.main_thread():
        # From here on a signal waits for the step in hand rather than cutting through it.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _: stop.append(signum))
    try:
        return _serve(runner, link, send, goodbye, stop, busy_poll_us, ranks)
    except GroupLost as e:
        # The scheduler recomputes this worker's sequences elsewhere at once, rather than
        # after --worker-timeout (the heartbeat thread would go on beating for a broken worker).
        logger.error("a tensor-parallel rank is lost (%s): saying goodbye to the scheduler", e)
        goodbye()
        return 1


def _serve(runner, link, send, goodbye, stop, busy_poll_us, ranks) -> int:
    sock = link.sock
    runner.warm_grammars()  # before the hello: the first request's step gets the CPU to itself
    # Start-up's objects (torch's, the model's: hundreds of thousands) out of the collector's
    # way: its passes over them took about 2% of a bf16 offline run (bench/step_trace.py, 553-560
    # against 564-573 tok/s frozen, AMX Xeon); what steps allocate is collected as before.
    gc.collect()
    gc.freeze()
    logger.info("%d start-up objects frozen out of the garbage collector's passes", gc.get_freeze_count())
    send(internal_pb2.WorkerMessage(hello=runner.hello()))
    last_sent = time.monotonic()
    busy_us = 0.0  # spin only while the next plan is due: right after a result
    while True:
        watchdog.tick()
        if stop:
            logger.info("%s: saying goodbye to the scheduler", signal.Signals(stop[0]).name)
            goodbye()
            return 0
        if ranks is not None and (why := ranks.lost()):
            raise GroupLost(why)
        if link.given_up():
            # What the scheduler sent since is lost, so it must treat this as a new worker: a
            # hello from a known worker id requeues whatever it had running here.
            logger.warning("the connection to the scheduler dropped and was not retried: "
                           "reconnecting on a new socket")
            sock = link.reopen()
            runner.forget_all()
            send(internal_pb2.WorkerMessage(hello=runner.hello()))
            last_sent = time.monotonic()
        if (compiled := runner.grammars_finished()) is not None:
            send(internal_pb2.WorkerMessage(compiled=compiled))
            last_sent = time.monotonic()
        wait_ms = max(0, int(min(STOP_CHECK_S, HEARTBEAT_S - (time.monotonic() - last_sent)) * 1000))
        if runner.compiling:  # say it is done soon after it is: sequences wait for it
            wait_ms = min(wait_ms, COMPILE_CHECK_MS)
        frames = receive(sock, wait_ms, busy_us)
        busy_us = 0.0
        if frames is not None:
            msg = internal_pb2.SchedulerToWorker()
            try:
                msg.ParseFromString(frames[-1])
            except Exception:  # noqa: BLE001 - a bad frame must not stop the worker
                logger.warning("dropping an unparseable message of %d bytes", len(frames[-1]))
                continue
            kind = msg.WhichOneof("kind")
            if kind == "plan":
                send(internal_pb2.WorkerMessage(result=runner.execute(msg.plan)))
                last_sent = time.monotonic()
                busy_us = busy_poll_us
            elif kind == "compile":
                runner.compile_grammars(msg.compile)
            elif kind == "shutdown":
                logger.info("shutdown requested by the scheduler")
                return 0
            elif kind == "refused":
                logger.error("the scheduler refused this worker: %s", msg.refused)
                return 1
            elif kind == "reregister":
                logger.info("the scheduler does not know this worker: saying hello again")
                runner.forget_all()  # a scheduler that asks knows none of our sequences
                send(internal_pb2.WorkerMessage(hello=runner.hello()))
                last_sent = time.monotonic()
        if time.monotonic() - last_sent >= HEARTBEAT_S:
            try:  # dropped, not queued, while no scheduler is connected
                send(internal_pb2.WorkerMessage(heartbeat=True), zmq.NOBLOCK)
            except zmq.Again:
                pass
            if ranks is not None:  # idle: the other ranks wait in a collective that times out
                ranks.keepalive()
            last_sent = time.monotonic()


def _exit_on_signal(signum, _frame) -> None:
    # SystemExit unwinds from wherever the process is (loading, a forward, a poll) through the
    # finally blocks; execute() catches Exception only, so it is not swallowed.
    logger.info("%s: exiting", signal.Signals(signum).name)
    raise SystemExit(0)


def main_socket(ctx: zmq.Context, args, hello: internal_pb2.WorkerHello, routing_id: bytes):
    """A function that opens the main socket, bounded, authenticated and connected."""
    def open_socket() -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        bound_socket(sock, args, hello)
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
        secure_client(sock, args.zmq_keys_dir, "worker")
        sock.connect(args.scheduler_worker_address)
        return sock
    return open_socket


def bound_socket(sock: zmq.Socket, args, hello: internal_pb2.WorkerHello) -> int:
    """Sets the main socket's bounds: the largest plan the scheduler may send this worker (a
    larger frame closes the connection for good; serve() then opens a new one) and the high-water
    marks. Returns the message bound."""
    max_bytes = args.max_message_bytes or largest_step_plan(
        hello.max_num_seqs, hello.max_num_batched_tokens, hello.max_model_len, hello.block_size,
        hello.num_cpu_blocks)
    logger.info("largest plan accepted: %d bytes", max_bytes)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.SNDHWM, args.zmq_hwm)
    sock.setsockopt(zmq.RCVHWM, args.zmq_hwm)
    return max_bytes


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = add_worker_args(argparse.ArgumentParser("pagoda worker", description=__doc__))
    args = watchdog.add_flag(parser, watchdog.WORKER_TIMEOUT_S).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    check_auth_args(args, args.scheduler_worker_address, role="worker")
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    # Before the ranks start: it takes the launcher's pid out of the environment they inherit.
    lifetime.start(DRAIN_S)
    watchdog.start(args.watchdog_timeout, watchdog.WORKER_TIMEOUT_S)  # armed by serve()'s loop

    from worker.runner import ModelRunner  # torch is imported only after the flags parse

    ranks = None
    if args.tensor_parallel_size != 1:
        from worker.parallel import ranks as tensor_parallel
        from worker.startup.device import resolve_device

        device = resolve_device(args.device)
        if tensor_parallel.is_follower():
            tp = tensor_parallel.join_group(args, device)
            return tensor_parallel.follow(ModelRunner(args, tp), tp)
        ranks = tensor_parallel.start_group(args, argv, device)
    try:
        code = _serve_scheduler(args, ModelRunner(args, ranks and ranks.tp), ranks)
    except BaseException:
        if ranks is not None:
            ranks.stop(graceful=False)  # the others may be inside a collective
        raise
    if ranks is not None:
        ranks.stop(graceful=code == 0)  # 0: serve returned between steps, with the group whole
    return code


def _serve_scheduler(args, runner, ranks) -> int:
    ctx = zmq.Context()
    routing_id = main_routing_id(runner.worker_id)
    link = Link(main_socket(ctx, args, runner.hello(), routing_id))
    try:
        logger.info("worker %s connected to %s", runner.worker_id, args.scheduler_worker_address)
        with heartbeats(ctx, args.scheduler_worker_address, routing_id, hwm=args.zmq_hwm,
                        keys_dir=args.zmq_keys_dir):
            return serve(runner, link, resolve_busy_poll_us(args.busy_poll_us), ranks)
    finally:
        link.finish()
        ctx.term()


if __name__ == "__main__":
    lifetime.exit_now(main_refusing(main))
