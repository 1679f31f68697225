"""Message size bounds computed from config (proto/sizes.py), not a fixed 64 MiB: the largest
valid message of each kind, built with the real encoder, passes a real ZeroMQ socket set to its
bound; a frame one byte larger makes ZeroMQ drop the connection, and the receiver (the real
scheduler process, in the second test; the fake worker process, bounded as worker.main bounds
the real one, in the third) goes on serving."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from gateway.bounds.grpc_bounds import CONTEXT_BOUND
from proto import internal_pb2 as ipb, pagoda_pb2
from proto.auth import secure_client
from proto.columns import pack, pack_f32, unpack
from proto.sizes import (MAX_ID_BYTES, MAX_LIST, MAX_LOGPROBS, largest_gateway_message,
                         largest_scheduler_message, largest_step_plan, largest_worker_message)
from scheduler import message_checks as checks
from scheduler.outbox import Outbox, split
from tests.cluster import wait_for
from tests.fake_cluster import FakeCluster
from tests.fake_worker import reference_output
from tests.unit.worker.test_worker_main import ROOT, receive
from tests.faults.test_faults_liveness import expected, request

SEQS, TOKENS, LEN, BS = 256, 2048, 8192, 16    # the defaults
BIG = (1 << 20) - 1                            # the largest id scheduler/message_checks.py lets through


def sampling() -> ipb.SamplingConfig:
    return ipb.SamplingConfig(logit_bias={BIG - i: -1.5 for i in range(MAX_LIST)},
                              stop_token_ids=[BIG] * MAX_LIST, logprobs=MAX_LOGPROBS,
                              prompt_logprobs=MAX_LOGPROBS)


def largest_gateway_messages() -> list[ipb.GatewayMessage]:
    add = ipb.AddRequest(request_id="r" * MAX_ID_BYTES, public_id="p" * MAX_ID_BYTES,
                         cache_salt="s" * MAX_ID_BYTES, prompt_token_ids=[BIG] * LEN,
                         sampling=sampling(), stop_token_ids=[BIG] * MAX_LIST, n=256,
                         max_tokens=BIG)
    assert checks.check_add(add, BIG + 1) is None  # valid
    call = ipb.Call(call_id=2**64 - 1, abort=pagoda_pb2.AbortRequest(
        request_ids=["a" * MAX_ID_BYTES] * MAX_LIST))
    assert checks.check_call(call) is None
    return [ipb.GatewayMessage(add=add), ipb.GatewayMessage(call=call)]


def logprobs(positions: int, k: int, kind=ipb.Logprobs, **kw):
    """The gateway link's Logprobs, or (kind) the worker link's SlotLogprobs."""
    return kind(first_position=BIG, k=k, token_ids=pack([BIG] * positions),
                        logprobs=pack_f32([-1.0] * positions), ranks=pack([BIG] * positions),
                        top_token_ids=pack([BIG] * positions * k),
                        top_logprobs=pack_f32([-2.0] * positions * k), **kw)


def largest_result() -> ipb.WorkerMessage:
    result = ipb.StepResult(step_id=2**64 - 1, slots=pack(range(SEQS)), token_ids=pack([BIG] * SEQS),
                            error="e" * (1 << 16), forward_seconds=1.0, logprobs=[
                                *(logprobs(1, MAX_LOGPROBS, ipb.SlotLogprobs, slot=s)
                                  for s in range(SEQS)),
                                logprobs(TOKENS, MAX_LOGPROBS, ipb.SlotLogprobs, slot=0, prompt=True)])
    assert checks.check_result(result, BIG + 1) is None
    return ipb.WorkerMessage(result=result)


def largest_plan() -> ipb.SchedulerToWorker:
    blocks = [BIG] * -(-LEN // BS)
    plan = ipb.StepPlan(
        step_id=2**64 - 1, new_seqs=[ipb.NewSeq(
            seq_id="r" * MAX_ID_BYTES + "#255", token_ids=[BIG] * LEN, sampling=sampling(),
            num_computed_tokens=LEN - 1, block_ids=blocks, num_new_tokens=1, slot=s,
            num_prompt_tokens=LEN - 1) for s in range(SEQS)],
        running_slots=pack([BIG] * SEQS), running_num_tokens=pack([BIG] * SEQS),
        new_block_slots=pack([BIG] * (TOKENS // BS + SEQS)),
        new_block_ids=pack([BIG] * (TOKENS // BS + SEQS)), dropped_slots=[BIG] * 2 * SEQS,
        copy=[ipb.BlockCopy(src=BIG, dst=BIG)] * SEQS)
    return ipb.SchedulerToWorker(plan=plan)


def scheduler_messages() -> list[ipb.SchedulerMessage]:
    """A step's outbox far past one message: 200,000 entries, a prompt's logprobs of 2048
    positions at k = 20, and the deltas, cut as the scheduler cuts them."""
    box = Outbox()
    for i in range(200_000):
        box.add("r" * 64 + str(i % 5000), 0, [BIG], i)
    box.logprobs.append(logprobs(TOKENS, 20, request_id="r" * MAX_ID_BYTES, prompt=True))
    box.deltas += [ipb.TokenDelta(request_id="r" * MAX_ID_BYTES, finish=ipb.ERROR, error=ipb.Error(
        code="RESOURCE_EXHAUSTED", message="m" * 4096))] * 100
    parts = split(box.to_message())
    assert sum(len(unpack(p.token_ids)) for p in parts) == 200_000 and len(parts) > 1
    assert sum(len(unpack(lp.token_ids)) for p in parts for lp in p.logprobs) == TOKENS
    return parts


def _pair(bound: int):
    ctx = zmq.Context()
    receiver, sender = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    receiver.setsockopt(zmq.MAXMSGSIZE, bound)
    port = receiver.bind_to_random_port("tcp://127.0.0.1")
    monitor = receiver.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sender.connect(f"tcp://127.0.0.1:{port}")
    return ctx, receiver, sender, monitor


def test_the_largest_valid_messages_pass_and_one_byte_more_is_dropped():
    cases = [
        ("GatewayMessage (scheduler)", largest_gateway_message(LEN), largest_gateway_messages()),
        ("WorkerMessage (scheduler)", largest_worker_message(SEQS, TOKENS, MAX_LOGPROBS), [largest_result()]),
        ("StepPlan (worker)", largest_step_plan(SEQS, TOKENS, LEN, BS, 0), [largest_plan()]),
        ("SchedulerMessage (gateway)", largest_scheduler_message(20, CONTEXT_BOUND), scheduler_messages()),
    ]
    print()
    for name, bound, msgs in cases:
        data = [m.SerializeToString() for m in msgs]
        largest = max(len(d) for d in data)
        print(f"{name}: bound {bound / 2**20:.2f} MiB, the largest valid message built "
              f"{largest / 2**20:.2f} MiB ({len(msgs)} built)")
        assert largest <= bound < 64 << 20
        ctx, receiver, sender, monitor = _pair(bound)
        try:
            for d in data:
                sender.send(d)
                assert receiver.poll(10_000), name
                assert receiver.recv_multipart()[1] == d
            sender.send(b"x" * (bound + 1))
            assert monitor.poll(5_000), f"{name}: an oversized frame did not drop the connection"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            assert not receiver.poll(200)  # and it never arrived
            sender.send(b"after")  # the sender reconnects by itself
            assert receiver.poll(10_000) and receiver.recv_multipart()[1] == b"after"
        finally:
            receiver.disable_monitor()
            for s in (monitor, sender, receiver):
                s.close(0)
            ctx.term()


def test_an_oversized_frame_to_the_scheduler_drops_the_peer_and_it_serves_on(tmp_path):
    with FakeCluster(tmp_path) as cluster:
        cluster.start()
        bounds = {cluster.gateway_address: (largest_gateway_message(LEN), "gateway"),
                  cluster.worker_address: (largest_worker_message(SEQS, TOKENS, MAX_LOGPROBS), "worker")}
        print()
        for address, (bound, role) in bounds.items():
            ctx = zmq.Context()
            sock = ctx.socket(zmq.DEALER)
            secure_client(sock, cluster.keys_flags[1], role)  # an authenticated peer
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(address)
            time.sleep(0.5)
            sock.send(b"x" * (bound + 1))
            dropped = monitor.poll(10_000)
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            ctx.term()
            started = time.monotonic()
            answer = cluster.stub.Generate(request(0, 8), timeout=30)
            print(f"{bound + 1} bytes to the scheduler's {role} socket (bound {bound}): "
                  f"connection dropped; a real request then got {len(answer.token_ids)} tokens "
                  f"in {time.monotonic() - started:.2f} s")
            assert dropped and list(answer.token_ids) == expected(0, 8)
            assert cluster.scheduler.poll() is None
        assert wait_for(lambda: cluster.num_workers() == 1, 5)



@contextlib.contextmanager
def oversized_plan_to_a_worker_process():
    """The fake worker process bounds its socket as worker.main does (bound_socket, from the
    bounds in its hello). A ROUTER plays the scheduler: a valid plan runs, a frame of exactly the
    bound arrives (and is dropped as unparseable), one byte more drops the connection. Yields
    (router, the worker's identity, run a plan, the process, what happened)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    address = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    proc = subprocess.Popen([sys.executable, "-m", "tests.fake_worker_main", "--insecure",
                             "--scheduler-worker-address", address, "--worker-id", "w"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def plan_on(ident: bytes, step_id: int, slot: int) -> list[int]:
        router.send_multipart([ident, ipb.SchedulerToWorker(plan=ipb.StepPlan(step_id=step_id, new_seqs=[
            ipb.NewSeq(seq_id=f"r{slot}", slot=slot, token_ids=[5, 6, 7], block_ids=[slot],
                       num_new_tokens=3, num_prompt_tokens=3)])).SerializeToString()])
        _, msg = receive(router, timeout_s=10)
        assert msg.result.step_id == step_id and not msg.result.error
        assert unpack(msg.result.slots).tolist() == [slot]
        return unpack(msg.result.token_ids).tolist()

    try:
        ident, msg = receive(router, timeout_s=30)
        h = msg.hello
        bound = largest_step_plan(h.max_num_seqs, h.max_num_batched_tokens, h.max_model_len,
                                  h.block_size, h.num_cpu_blocks)
        assert (h.max_num_seqs, h.max_num_batched_tokens) == (SEQS, TOKENS)  # its flags' defaults
        assert plan_on(ident, 1, 0) == reference_output([5, 6, 7], 1)
        router.send_multipart([ident, b"\xff" * bound])  # arrives: not a plan, dropped by the worker
        early = monitor.poll(1_000)
        router.send_multipart([ident, b"\xff" * (bound + 1)])
        dropped = monitor.poll(10_000) and (
            recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED)
        beats = [receive(router, timeout_s=5, skip_heartbeats=False) for _ in range(6)]
        yield router, ident, plan_on, proc, dict(bound=bound, early=early, dropped=dropped,
                                                 beats=beats, max_model_len=h.max_model_len)
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
        router.disable_monitor()
        monitor.close(0)
        router.close(0)
        ctx.term()


def test_an_oversized_plan_to_a_worker_process_drops_its_connection_and_it_lives():
    with oversized_plan_to_a_worker_process() as (_, ident, _, proc, seen):
        bound = seen["bound"]
        alive = proc.poll() is None
        print(f"\nfake worker process (bound {bound} bytes = {bound / 2**20:.2f} MiB at max_model_len "
              f"{seen['max_model_len']}): {bound} bytes arrived, {bound + 1} dropped the "
              f"connection: {seen['dropped']}; alive: {alive}")
        assert not seen["early"] and seen["dropped"] and alive
        assert any(m.heartbeat_of == ident for _, m in seen["beats"])  # its heartbeat thread beats on
        proc.terminate()
        output = proc.communicate(timeout=10)[0]  # the fixture's finally then finds it ended
    assert f"largest plan accepted: {bound} bytes" in output, output
    assert f"dropping an unparseable message of {bound} bytes" in output, output
    assert f"of {bound + 1} bytes" not in output and "Traceback" not in output, output


def test_after_an_oversized_plan_the_worker_reconnects_and_runs_the_next_plan():
    """libzmq does not retry a connection it closed for a protocol error; the worker notices
    (worker.main.Link) and says hello again on a new socket, as a new worker."""
    with oversized_plan_to_a_worker_process() as (router, ident, plan_on, proc, _):
        started, hello = time.monotonic(), None
        while hello is None and time.monotonic() - started < 10:
            sender, msg = receive(router, 10, skip_heartbeats=False)
            if sender == ident and msg.WhichOneof("kind") == "hello":
                hello = msg.hello
        print(f"\nthe worker said hello again {time.monotonic() - started:.2f} s after the drop")
        assert hello is not None and hello.worker_id == "w"
        assert plan_on(ident, 2, 1) == reference_output([5, 6, 7], 1) and proc.poll() is None
