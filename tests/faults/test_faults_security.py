"""Hostile peers and hostile input against the real cluster (CURVE on, as `make run` runs it):
each is refused or dropped, no process dies, and real requests are served afterwards."""
from __future__ import annotations

import asyncio
import collections
import random
import time

import grpc
import pytest
import zmq
from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from proto import internal_pb2 as ipb, pagoda_pb2 as pb, pagoda_pb2_grpc
from proto.auth import PROTOCOL_VERSION, secure_client
from tests.cluster import wait_for

pytestmark = pytest.mark.integration

NUM_FUZZ = 1000  # of each message type


def _peer(ctx, address, keys_dir, role, stranger=False, plain=False):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if not plain:
        secure_client(sock, keys_dir, role)
    if stranger:  # knows the scheduler's public key, but its own key was never authorized
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(address)
    return sock


def _recv(sock, parse, timeout=5.0):
    if not sock.poll(int(timeout * 1000)):
        return None
    return parse(sock.recv_multipart()[-1])


def _worker_hello(**changes) -> ipb.WorkerHello:
    hello = ipb.WorkerHello(worker_id="intruder", model="SmolLM2-135M-Instruct", num_blocks=64,
                            block_size=16, max_model_len=2048, vocab_size=49152, device="cpu",
                            eos_token_ids=[2], protocol_version=PROTOCOL_VERSION)
    for k, v in changes.items():
        setattr(hello, k, v)
    return hello


def _serves_one_request(cluster, stub) -> int:
    r = stub.Generate(pb.GenerateRequest(prompt="Name a colour.", sampling=pb.SamplingParams(
        temperature=0), stopping=pb.StoppingCriteria(max_tokens=8, ignore_eos=True)), timeout=120)
    assert cluster.proc.poll() is None, cluster.log_tail()
    assert cluster.metric("pagoda_kv_blocks_total") == 256, "the real worker is gone"
    return len(r.token_ids)


def test_hostile_peers_are_refused_and_the_scheduler_serves_on(cluster, stub):
    ctx = zmq.Context()
    outcome = {}
    try:
        for name, changes in {"block_size=0": dict(block_size=0),
                              "num_blocks=2**32-1": dict(num_blocks=2 ** 32 - 1),
                              "protocol_version=99": dict(protocol_version=99),
                              "another model": dict(model="llama-70b")}.items():
            sock = _peer(ctx, cluster.worker_address, cluster.keys_dir, "worker")
            sock.send(ipb.WorkerMessage(hello=_worker_hello(**changes)).SerializeToString())
            reply = _recv(sock, ipb.SchedulerToWorker.FromString)
            outcome[f"worker hello {name}"] = reply.refused if reply is not None else "no answer"
            sock.close(0)
        for name, kw in {"stranger key": dict(stranger=True), "no CURVE": dict(plain=True)}.items():
            sock = _peer(ctx, cluster.worker_address, cluster.keys_dir, "worker", **kw)
            sock.send(ipb.WorkerMessage(hello=_worker_hello()).SerializeToString())
            reply = _recv(sock, ipb.SchedulerToWorker.FromString, timeout=3)
            outcome[f"worker with {name}"] = "no answer" if reply is None else str(reply)
            sock.close(0)

        gw = _peer(ctx, cluster.gateway_address, cluster.keys_dir, "gateway")
        garbage = [[b"\xff" * 100], [b"\x0a\xff\xff\xff\xff\x0f"], [b"a", b"b", b"c"], [b""]]
        for frames in garbage:
            gw.send_multipart(frames)
        gw.send(ipb.GatewayMessage(add=ipb.AddRequest(
            request_id="evil-1", prompt_token_ids=[10 ** 9], max_tokens=4)).SerializeToString())
        delta = _recv(gw, ipb.SchedulerMessage.FromString)
        outcome["add with token 10**9"] = f"{delta.deltas[0].error.code}: {delta.deltas[0].error.message}"
        gw.send(ipb.GatewayMessage(hello=ipb.GatewayHello(protocol_version=99)).SerializeToString())
        outcome["gateway hello protocol_version=99"] = _recv(gw, ipb.SchedulerMessage.FromString).refused
        gw.send(ipb.GatewayMessage(hello=ipb.GatewayHello(
            protocol_version=PROTOCOL_VERSION)).SerializeToString())
        info = _recv(gw, ipb.SchedulerMessage.FromString).info
        gw.close(0)
    finally:
        ctx.term()
    t0 = time.monotonic()
    tokens = _serves_one_request(cluster, stub)
    for k, v in outcome.items():
        print(f"\n  {k}: {v}", end="")
    print(f"\nthen: {len(garbage)} garbage frames dropped, the scheduler answers a good hello with "
          f"{info.num_workers} worker(s), a real request got {tokens} tokens in "
          f"{time.monotonic() - t0:.2f} s")
    assert "block_size" in outcome["worker hello block_size=0"]
    assert "num_blocks" in outcome["worker hello num_blocks=2**32-1"]
    assert "protocol_version" in outcome["worker hello protocol_version=99"]
    assert "llama-70b" in outcome["worker hello another model"]
    assert outcome["worker with stranger key"] == outcome["worker with no CURVE"] == "no answer"
    assert outcome["add with token 10**9"].startswith("INVALID_ARGUMENT: prompt_token_ids")
    assert "protocol_version" in outcome["gateway hello protocol_version=99"]
    assert info.num_workers == 1 and tokens == 8


# ---------------------------------------------------------------------------- fuzzing

_SCALARS = {
    F.TYPE_INT32: st.integers(-2 ** 31, 2 ** 31 - 1), F.TYPE_SINT32: st.integers(-2 ** 31, 2 ** 31 - 1),
    F.TYPE_UINT32: st.integers(0, 2 ** 32 - 1), F.TYPE_INT64: st.integers(-2 ** 63, 2 ** 63 - 1),
    F.TYPE_UINT64: st.integers(0, 2 ** 64 - 1), F.TYPE_BOOL: st.booleans(),
    F.TYPE_FLOAT: st.floats(width=32), F.TYPE_DOUBLE: st.floats(),
    F.TYPE_STRING: st.text(max_size=24), F.TYPE_BYTES: st.binary(max_size=64),
    F.TYPE_ENUM: st.integers(-2, 6),
}


def from_schema(descriptor, depth: int = 0):
    """Any message of this type: each field absent or random, nested messages to depth 3."""
    fields = {}
    for f in descriptor.fields:
        if f.type == F.TYPE_MESSAGE:
            if depth >= 3:
                continue
            if f.message_type.GetOptions().map_entry:
                key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
                fields[f.name] = st.dictionaries(_SCALARS[key.type], _SCALARS[value.type], max_size=4)
                continue
            one = from_schema(f.message_type, depth + 1)
        else:
            one = _SCALARS[f.type]
        fields[f.name] = st.lists(one, max_size=6) if f.is_repeated else one

    def build(values):
        msg = GetMessageClass(descriptor)()
        for name, value in values.items():
            field = getattr(msg, name)
            if isinstance(value, dict):
                field.update(value)
            elif isinstance(value, list):
                if value and hasattr(value[0], "SerializeToString"):
                    for v in value:
                        field.add().CopyFrom(v)
                else:
                    field.extend(value)
            elif hasattr(value, "SerializeToString"):
                field.CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg
    return st.fixed_dictionaries({}, optional=fields).map(build)


def _fuzz(strategy, send, n: int = NUM_FUZZ) -> None:
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def body(data):
        send(data)
    body()


def _frames(descriptor):
    """Serialized random messages, and now and then bytes that are no message at all."""
    return st.one_of(from_schema(descriptor).map(lambda m: m.SerializeToString()),
                     st.binary(max_size=200))


def test_fuzzed_internal_messages_kill_nothing(cluster, stub):
    ctx = zmq.Context()
    gw = _peer(ctx, cluster.gateway_address, cluster.keys_dir, "gateway")
    wk = _peer(ctx, cluster.worker_address, cluster.keys_dir, "worker")
    added = set()

    def to_scheduler(data):
        msg = ipb.GatewayMessage()
        try:
            msg.ParseFromString(data)
            if msg.WhichOneof("kind") == "add":
                added.add(msg.add.request_id)
        except Exception:  # noqa: BLE001 - garbage bytes are part of the fuzz
            pass
        gw.send(data)
        while gw.poll(0):
            gw.recv_multipart()

    def from_worker(data):
        wk.send(data)
        while wk.poll(0):
            wk.recv_multipart()

    t0, log_start = time.monotonic(), len(cluster.log_path.read_text())
    try:
        _fuzz(_frames(ipb.GatewayMessage.DESCRIPTOR), to_scheduler)
        _fuzz(_frames(ipb.WorkerMessage.DESCRIPTOR), from_worker)
        fuzz_s = time.monotonic() - t0
        for rid in added:  # the fuzz's admitted requests would run on: end them
            gw.send(ipb.GatewayMessage(abort=ipb.AbortRequest(request_id=rid)).SerializeToString())
        assert wait_for(lambda: cluster.metric("pagoda_num_requests_running") == 0
                        and cluster.metric("pagoda_num_requests_waiting") == 0, 60)
    finally:
        gw.close(0)
        wk.close(0)
        ctx.term()
    tokens = _serves_one_request(cluster, stub)
    log = cluster.log_path.read_text()[log_start:]
    dropped = log.count("dropped a ") + log.count("refused worker") + log.count("refused gateway")
    print(f"\n{2 * NUM_FUZZ} fuzzed internal messages ({len(added)} adds) in {fuzz_s:.1f} s: "
          f"{dropped} dropped or refused by the checks, scheduler and worker alive, a real "
          f"request then got {tokens} tokens")
    assert tokens == 8
    # Every bad message was caught by scheduler/message_checks.py, not by the loop's last-resort guard.
    assert "could not be handled" not in log and "Traceback" not in log


def test_fuzzed_public_requests_get_proper_statuses(cluster, stub):
    requests = []
    _fuzz(from_schema(pb.GenerateRequest.DESCRIPTOR), requests.append)
    bad = []

    async def one(stub, req, sem, codes):
        async with sem:
            call = stub.GenerateStream(req, timeout=10)  # DEADLINE_EXCEEDED is a proper answer too
            try:
                async for _ in call:
                    break  # an accepted request: its first answer is enough
                call.cancel()
                codes["OK"] += 1
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1
                if e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) or \
                        "Traceback" in (e.details() or ""):
                    bad.append((req, e.code().name, e.details()))

    async def all_of():
        codes = collections.Counter()
        async with grpc.aio.insecure_channel(cluster.target) as ch:
            s = pagoda_pb2_grpc.GenerationStub(ch)
            sem = asyncio.Semaphore(32)
            await asyncio.gather(*(one(s, r, sem, codes) for r in requests))
        return codes

    t0 = time.monotonic()
    codes = asyncio.run(all_of())
    sent_s = time.monotonic() - t0
    assert wait_for(lambda: cluster.metric("pagoda_num_requests_running") == 0, 60)
    tokens = _serves_one_request(cluster, stub)
    print(f"\n{len(requests)} fuzzed GenerateRequests answered in {sent_s:.1f} s: "
          f"{dict(codes)}; a real request then got {tokens} tokens")
    assert bad == [] and sum(codes.values()) == len(requests) >= NUM_FUZZ * 0.9


# ---------------------------------------------------------------------------- cache salt

def test_cached_tokens_only_with_the_same_salt(stub):
    prompt = random.Random(7).choices(range(100, 40000), k=40)  # 2 full blocks of 16, unseen
    cached = {}
    for name, salt in (("s1 first", "s1"), ("s1 again", "s1"), ("s2", "s2"), ("unsalted", ""),
                       ("unsalted again", "")):
        r = stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, cache_salt=salt,
                                             stopping=pb.StoppingCriteria(max_tokens=1)), timeout=120)
        cached[name] = r.usage.cached_prompt_tokens
    print(f"\ncached prompt tokens of one 40-token prompt: {cached}")
    assert cached == {"s1 first": 0, "s1 again": 32, "s2": 0, "unsalted": 0, "unsalted again": 32}
