"""The scheduler's loop under gateway traffic, in-process: the real SchedulerServer on inproc
sockets, raw DEALERs as its gateway and worker, one turn of the loop at a time. A turn serves the
workers first and handles a bounded batch of gateway messages; refusals leave in one message
per turn; an unreachable gateway costs one log line a second; and a gateway declared silent and
then heard again gets the next numbers on its link, never seq 1 again (scheduler/links.py); a
worker whose goodbye is read only after a plan to it failed leaves for the reason it gave."""
from __future__ import annotations

import argparse
import itertools
import logging
import time

import pytest
import zmq

from proto import internal_pb2 as pb
from proto.auth import PROTOCOL_VERSION
from proto.token_stream import updates
from scheduler import server as server_module
from scheduler.scheduler_flags import add_scheduler_args
from scheduler.links import GatewayLinks
from scheduler.server import SchedulerServer
from tests.fake_worker import FakeWorker, reference_output

_names = itertools.count()


@pytest.fixture
def make_server():
    made = []

    def make(*flags: str) -> SchedulerServer:
        n = next(_names)
        args = add_scheduler_args(argparse.ArgumentParser()).parse_args([
            "--scheduler-gateway-address", f"inproc://gateways-{n}",
            "--scheduler-worker-address", f"inproc://workers-{n}", "--busy-poll-us", "0", *flags])
        made.append(SchedulerServer(args))
        made[-1].test_peers = []
        return made[-1]
    yield make
    for s in made:
        for sock in s.test_peers:  # else ctx.term() waits for them
            sock.close(0)
        s._shutdown()


def peer(server: SchedulerServer, sock: zmq.Socket, routing_id: bytes) -> zmq.Socket:
    dealer = server.ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.ROUTING_ID, routing_id)
    dealer.connect(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    server.test_peers.append(dealer)
    return dealer


def received(sock: zmq.Socket) -> list[pb.SchedulerMessage]:
    out = []
    while sock.poll(50):
        msg = pb.SchedulerMessage()
        msg.ParseFromString(sock.recv())
        out.append(msg)
    return out


def add(i: int) -> bytes:
    return pb.GatewayMessage(add=pb.AddRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, 3],
                                               max_tokens=4)).SerializeToString()


def hello() -> bytes:
    return pb.GatewayMessage(hello=pb.GatewayHello(protocol_version=PROTOCOL_VERSION)).SerializeToString()


def test_a_turn_serves_the_workers_first_and_a_bounded_batch_of_gateway_messages(make_server):
    server = make_server("--max-waiting-requests", "0")  # every add is refused
    worker = peer(server, server.workers, b"w0")
    worker.send(pb.WorkerMessage(hello=FakeWorker(64).hello()).SerializeToString())
    server.turn()
    assert b"w0" in server.router.workers
    gateway = peer(server, server.gateways, b"gw")
    sent = 0
    for i in range(1500):  # fill the pipe up to its high-water marks
        try:
            gateway.send(add(i), zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            break
    assert sent > 3 * server_module._GATEWAY_BATCH
    # The worker's last heartbeat is long past --worker-timeout; a new one waits behind the adds.
    server.router.workers[b"w0"].last_seen = time.monotonic() - 60
    worker.send(pb.WorkerMessage(heartbeat_of=b"w0").SerializeToString())
    server.last_check = 0.0  # the liveness check is due in this turn
    server.turn()
    assert b"w0" in server.router.workers  # its heartbeat counted before the check
    first = received(gateway)
    assert len(first) == 1  # this turn's refusals, in one message
    assert len(first[0].deltas) == server_module._GATEWAY_BATCH
    answers = list(first[0].deltas)
    messages = first
    while len(answers) < sent:
        server.turn(timeout_ms=0)
        batch = received(gateway)
        assert len(batch) == 1 and len(batch[0].deltas) <= server_module._GATEWAY_BATCH
        answers += batch[0].deltas
        messages += batch
    assert [d.request_id for d in answers] == [f"r{i}" for i in range(sent)]
    assert {(d.finish, d.error.code) for d in answers} == {(pb.ERROR, "RESOURCE_EXHAUSTED")}
    assert [m.seq for m in messages] == list(range(1, len(messages) + 1))
    assert {m.epoch for m in messages} == {server.epoch}


def test_an_unreachable_gateway_is_logged_once_a_second_with_a_count(make_server, caplog):
    server = make_server()
    caplog.set_level(logging.WARNING, logger="pagoda.scheduler")
    for _ in range(1000):
        assert not server._send(server.gateways, b"nobody", pb.SchedulerMessage())
    lines = [r.getMessage() for r in caplog.records if "cannot reach" in r.getMessage()]
    assert len(lines) == 1 and server.unreachable.total == 1000
    time.sleep(1.05)
    server._send(server.gateways, b"nobody", pb.SchedulerMessage())
    lines = [r.getMessage() for r in caplog.records if "cannot reach" in r.getMessage()]
    assert len(lines) == 2 and lines[1].endswith("(and 999 more such since the last line)")


def accepted_by_a_gateway(messages: list[pb.SchedulerMessage]) -> list[pb.SchedulerMessage]:
    """What gateway/scheduler_link/scheduler_client.py keeps: not a repeat within one epoch."""
    epoch, seq, kept = 0, 0, []
    for msg in messages:
        if msg.epoch == epoch and msg.seq <= seq:
            continue
        epoch, seq = msg.epoch, msg.seq
        kept.append(msg)
    return kept


def test_a_gateway_declared_silent_and_heard_again_goes_on_numbering_its_link(make_server):
    server = make_server("--gateway-timeout", "1")
    worker = peer(server, server.workers, b"w0")  # takes plans, never answers
    worker.send(pb.WorkerMessage(hello=FakeWorker(64).hello()).SerializeToString())
    server.turn()
    gateway = peer(server, server.gateways, b"gw")
    gateway.send(hello())
    gateway.send(add(0))
    while not (server.router.seqs and server.gateway_seen):
        server.turn()
    before = received(gateway)
    assert [m.HasField("info") for m in before] == [True]
    # Silent past --gateway-timeout: its request is aborted with UNAVAILABLE.
    server.gateway_seen[b"gw"] -= 10
    server.last_check = 0.0
    server.turn(timeout_ms=0)
    assert b"gw" not in server.gateway_seen and not server.router.seqs
    gateway.send(hello())  # heard again
    server.turn()
    after = received(gateway)
    assert [(d.request_id, d.error.code) for m in after for d in m.deltas] == [("r0", "UNAVAILABLE")]
    assert after[-1].HasField("info") and b"gw" in server.gateway_seen
    messages = before + after
    assert [m.seq for m in messages] == [1, 2, 3] and {m.epoch for m in messages} == {server.epoch}
    assert accepted_by_a_gateway(messages) == messages


def test_link_numbers_stay_bounded_and_a_forgotten_link_never_repeats_a_number():
    leased = {b"live"}
    links = GatewayLinks(epoch=7, leased=leased, max_links=4)
    last: dict[bytes, int] = {}

    def number(ident: bytes) -> int:
        msg = pb.SchedulerMessage()
        links.number(ident, msg)
        assert msg.epoch == 7
        assert msg.seq > last.get(ident, 0)  # never a repeat on any link
        last[ident] = msg.seq
        return msg.seq

    assert [number(b"live") for _ in range(3)] == [1, 2, 3]
    for round_ in range(5):
        for i in range(10):
            for _ in range(round_ + 1):
                number(f"gone-{i}".encode())
            assert len(links.seqs) <= 4 + 1
    assert number(b"live") == 4  # a leased link is never forgotten


def test_a_worker_that_said_goodbye_and_closed_leaves_for_that_reason_though_a_plan_failed_first(
        make_server, caplog):
    """The race of a stopping worker: its goodbye arrives and its connection closes after the
    turn read the workers, so the plan sent to it fails before the goodbye is read."""
    server = make_server()
    caplog.set_level(logging.WARNING, logger="pagoda.scheduler")
    leaving, staying = peer(server, server.workers, b"w0"), peer(server, server.workers, b"w1")
    for ident, sock in ((b"w0", leaving), (b"w1", staying)):
        sock.send(pb.WorkerMessage(hello=FakeWorker(64).hello()).SerializeToString())
        while ident not in server.router.workers:
            server.turn()
    gateway = peer(server, server.gateways, b"gw")
    gateway.send(hello())
    for i in range(4):
        gateway.send(add(i))
    planned = server.router.plans

    def plans_then_goodbye():
        plans = planned()
        # Between this turn's read of the workers and its send of w0's first plan.
        if leaving in server.test_peers and b"w0" in dict(plans):
            leaving.send(pb.WorkerMessage(goodbye=True).SerializeToString())
            leaving.close(0)
            server.test_peers.remove(leaving)
            while True:  # until the scheduler's socket sees it gone, as when the race happens
                try:
                    server.workers.send_multipart([b"w0", b""], zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
                time.sleep(0.001)
        return plans
    server.router.plans = plans_then_goodbye
    while leaving in server.test_peers:
        server.turn()
    drops = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert [d.split(" dropped ")[1].split(";")[0] for d in drops] == ["(said goodbye)"]
    assert any("cannot reach" in r.getMessage() for r in caplog.records)  # the race did happen
    assert list(server.router.workers) == [b"w1"]
    # Nothing is lost: the worker left (a fake that answers) completes every request.
    fake, tokens, finished = FakeWorker(64), {}, set()
    for _ in range(50):
        while staying.poll(0):
            msg = pb.SchedulerToWorker()
            msg.ParseFromString(staying.recv())
            if msg.HasField("plan"):
                staying.send(pb.WorkerMessage(result=fake.execute(msg.plan)).SerializeToString())
        server.turn(timeout_ms=10)
        for update in (u for m in received(gateway) for u in updates(m)):
            tokens.setdefault(update.request_id, []).extend(update.token_ids)
            if update.finish:
                finished.add(update.request_id)
        if len(finished) == 4:
            break
    assert tokens == {f"r{i}": reference_output([1, 2, 3], 4) for i in range(4)}
