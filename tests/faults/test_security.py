"""Authentication and hostile input, without the model: CURVE on real ZeroMQ sockets, the
scheduler's range checks, salted prefix-cache keys, and the gateway's API keys and TLS over real
gRPC against the fake scheduler. The real cluster's side is in test_faults_security.py."""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import grpc
import pytest
import zmq
import zmq.auth
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.app import Gateway
from gateway.tokenizer import load_tokenizer
from proto import internal_pb2 as ipb, pagoda_pb2 as pb, pagoda_pb2_grpc
from proto.auth import CurveServer, check_auth_args, create_keys, secure_client
from scheduler import message_checks as checks
from scheduler.block_pool import full_block_hashes
from tests.fake_scheduler import FakeScheduler, until, workers_of
from tests.fake_worker import FakeWorker, reference_output
from tests.unit.scheduler.test_scheduler import add, make_router, run, with_workers

TOK = load_tokenizer("")

# ---------------------------------------------------------------------------- CURVE


def _client(ctx, address, keys_dir=None, role="worker", own_keys=None):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, keys_dir, role)
    if own_keys is not None:  # a stranger: the right server key, a key pair nobody authorized
        sock.curve_publickey, sock.curve_secretkey = own_keys
    sock.connect(address)
    return sock


def test_only_authorized_keys_reach_a_curve_socket(tmp_path):
    """The worker socket: only the worker key gets through (the role binding itself, both
    sockets both ways, is tests/unit/proto/test_auth_roles.py's)."""
    keys = create_keys(tmp_path / "keys")
    ctx = zmq.Context()
    server = CurveServer(ctx, keys)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    server.secure(router, "worker")
    address = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        stranger = _client(ctx, address, keys, own_keys=zmq.curve_keypair())
        plain = _client(ctx, address)
        worker = _client(ctx, address, keys, "worker")
        gateway = _client(ctx, address, keys, "gateway")
        for sock, payload in ((stranger, b"stranger"), (plain, b"plain"), (worker, b"worker"),
                              (gateway, b"gateway")):
            sock.send(payload)
        got = set()
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            if router.poll(100):
                got.add(router.recv_multipart()[-1])
        print(f"\nCURVE: delivered {sorted(got)}; refused stranger key, plain peer, gateway key")
        assert got == {b"worker"}
    finally:
        for s in (stranger, plain, worker, gateway, router):
            s.close(0)
        server.stop()
        ctx.term()


def test_the_launcher_makes_a_key_set_once_and_hands_it_to_every_process(tmp_path):
    from launch.flag_routing import process_parsers, route_flags, with_keys
    routed = route_flags(with_keys(["--port", "6000"], tmp_path / "keys"), process_parsers())
    for name in ("scheduler", "worker", "gateway"):
        assert routed[name][-2:] == ["--zmq-keys-dir", str(tmp_path / "keys")]
    secret = (tmp_path / "keys" / "scheduler.key_secret").read_bytes()
    authorized = tmp_path / "keys" / "authorized"
    assert sorted(str(p.relative_to(authorized)) for p in authorized.rglob("*")) == [
        "gateway", "gateway/gateway.key", "worker", "worker/worker.key"]
    with_keys([], tmp_path / "keys")
    assert (tmp_path / "keys" / "scheduler.key_secret").read_bytes() == secret  # kept, not remade
    assert with_keys(["--insecure"], tmp_path / "other") == ["--insecure"]
    assert not (tmp_path / "other").exists()


def _args(**kw):
    return argparse.Namespace(**{"zmq_keys_dir": None, "insecure": False, **kw})


def test_insecure_is_explicit_and_loopback_only(tmp_path):
    with pytest.raises(SystemExit, match="--zmq-keys-dir DIR"):
        check_auth_args(_args(), "tcp://127.0.0.1:5555")
    with pytest.raises(SystemExit, match="loopback only, not tcp://0.0.0.0:5555"):
        check_auth_args(_args(insecure=True), "tcp://0.0.0.0:5555", "tcp://127.0.0.1:5556")
    check_auth_args(_args(insecure=True), "tcp://127.0.0.1:5555")
    with pytest.raises(SystemExit, match="no scheduler.key"):
        check_auth_args(_args(zmq_keys_dir=str(tmp_path)), "tcp://0.0.0.0:5555")
    check_auth_args(_args(zmq_keys_dir=str(create_keys(tmp_path / "k"))), "tcp://0.0.0.0:5555")


def test_a_refused_gateway_says_why_and_stays_without_a_cluster(caplog):
    from gateway.scheduler_link.scheduler_client import SchedulerClient
    from proto.auth import PROTOCOL_VERSION
    OTHER = PROTOCOL_VERSION + 1

    async def body():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        address = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
        client = SchedulerClient(address, model="SmolLM2-135M-Instruct", keepalive_interval=0.05)
        await client.start()
        try:
            peer, data = await asyncio.wait_for(router.recv_multipart(), 5)
            hello = ipb.GatewayMessage.FromString(data).hello
            await router.send_multipart([peer, ipb.SchedulerMessage(
                refused=f"protocol_version: the gateway speaks version {PROTOCOL_VERSION}, this scheduler {OTHER}"
            ).SerializeToString()])
            await until(lambda: client.refused)
            # An answer from a scheduler of another version is not believed either.
            await router.send_multipart([peer, ipb.SchedulerMessage(info=ipb.ClusterInfo(
                num_workers=1, protocol_version=OTHER)).SerializeToString()])
            await until(lambda: f"version {OTHER}" in client.refused)
            return hello, client.info
        finally:
            await client.close()
            router.close(0)
            ctx.term()

    import zmq.asyncio
    hello, info = asyncio.run(body())
    assert (hello.protocol_version, hello.model) == (PROTOCOL_VERSION, "SmolLM2-135M-Instruct")
    assert info is None
    assert "the scheduler refused this gateway: protocol_version" in caplog.text


# ---------------------------------------------------------------------------- range checks

@pytest.mark.parametrize("field,value", [
    ("block_size", 0), ("num_blocks", 2 ** 32 - 1), ("num_blocks", 0), ("max_model_len", 0),
    ("vocab_size", 0), ("num_cpu_blocks", 2 ** 31), ("swap_bytes_per_s", float("nan")),
    ("protocol_version", 99), ("worker_id", ""), ("eos_token_ids", [10 ** 9]),
    ("num_speculative_tokens", 10 ** 6),
])
def test_a_bad_hello_is_refused_naming_its_field(field, value):
    hello = FakeWorker(16).hello()
    if isinstance(value, list):
        del hello.eos_token_ids[:]
        hello.eos_token_ids.extend(value)
    else:
        setattr(hello, field, value)
    why = checks.check_worker_hello(hello)
    assert why is not None and field.split("_token")[0] in why, why


def test_a_good_hello_passes():
    assert checks.check_worker_hello(FakeWorker(16).hello()) is None


@pytest.mark.parametrize("mutate,field", [
    (lambda a: a.prompt_token_ids.append(10 ** 6), "prompt_token_ids"),
    (lambda a: setattr(a, "n", 100000), "n"),
    (lambda a: setattr(a.sampling, "top_k", -1), "sampling.top_k"),
    (lambda a: setattr(a.sampling, "temperature", float("inf")), "sampling.temperature"),
    (lambda a: a.sampling.logit_bias.__setitem__(5, float("nan")), "sampling.logit_bias"),
    (lambda a: setattr(a, "cache_salt", "x" * 5000), "cache_salt"),
    (lambda a: a.stop_token_ids.append(4000), "stop_token_ids"),
])
def test_a_bad_add_is_refused_naming_its_field(mutate, field):
    a = ipb.AddRequest(request_id="r", prompt_token_ids=[1, 2, 3], max_tokens=4)
    assert checks.check_add(a, vocab_size=1000) is None
    mutate(a)
    why = checks.check_add(a, vocab_size=1000)
    assert why is not None and why.startswith(field), why


def test_a_result_with_tokens_outside_the_vocabulary_is_refused():
    from proto.columns import pack
    good = ipb.StepResult(step_id=1, slots=pack([0, 1]), token_ids=pack([5, 999]))
    assert checks.check_result(good, vocab_size=1000) is None
    assert "vocabulary" in checks.check_result(
        ipb.StepResult(step_id=1, slots=pack([0]), token_ids=pack([1000])), vocab_size=1000)
    assert "slots" in checks.check_result(
        ipb.StepResult(step_id=1, slots=pack([0, 1]), token_ids=pack([1])), vocab_size=1000)
    assert "whole number" in checks.check_result(
        ipb.StepResult(step_id=1, slots=b"abc", token_ids=b""), vocab_size=1000)


@pytest.mark.parametrize("num_tokens,num_drafts,named", [
    ([3, 1], [2, 0], None),          # row 0 accepted 2 of 2 proposals, row 1 proposed none
    ([3], [2], "num_tokens"),        # one run for two slots
    ([0, 4], [0, 3], "num_tokens"),  # a run of no token
    ([3, 1], [1, 0], "num_tokens"),  # 2 accepted of 1 proposed
    ([2, 1], [1, 0], "add up"),      # runs of 3 tokens, 4 sent
    ([3, 1], [2, -1], "num_tokens"),
])
def test_a_result_whose_runs_do_not_cover_its_tokens_is_refused(num_tokens, num_drafts, named):
    from proto.columns import pack
    result = ipb.StepResult(step_id=1, slots=pack([0, 1]), token_ids=pack([5, 6, 7, 8]),
                            num_tokens=pack(num_tokens), num_drafts=pack(num_drafts))
    why = checks.check_result(result, vocab_size=1000)
    assert why is None if named is None else named in why, why


def test_a_plan_with_ids_outside_the_cache_or_vocabulary_is_refused_by_the_worker():
    from proto.columns import pack
    from worker.step.plan_checks import check_plan
    ok = ipb.StepPlan(step_id=1, new_seqs=[ipb.NewSeq(seq_id="s", token_ids=[1, 2, 3], block_ids=[0],
                                                      num_new_tokens=3)],
                      running_slots=pack([4]), running_num_tokens=pack([1]),
                      new_block_slots=pack([4]), new_block_ids=pack([7]))
    assert check_plan(ok, num_blocks=8, num_cpu_blocks=0, vocab_size=100) is None
    bad = {"new_block_ids": dict(new_block_ids=pack([8])),
           "copy": dict(copy=[ipb.BlockCopy(src=0, dst=9)]),
           "swap_out.dst": dict(swap_out=[ipb.BlockCopy(src=0, dst=0)]),
           "new_seqs[t].token_ids": dict(new_seqs=[ipb.NewSeq(seq_id="t", token_ids=[100])]),
           "new_seqs[u] computes": dict(new_seqs=[ipb.NewSeq(seq_id="u", token_ids=[1],
                                                             num_new_tokens=2)]),
           "running, new-block or next-token": dict(running_num_tokens=pack([1, 1]))}
    for field, change in bad.items():
        plan = ipb.StepPlan()
        plan.CopyFrom(ok)
        for k, v in change.items():
            plan.ClearField(k)
            getattr(plan, k).extend(v) if isinstance(v, list) else setattr(plan, k, v)
        why = check_plan(plan, num_blocks=8, num_cpu_blocks=0, vocab_size=100)
        assert why is not None and why.startswith(field), (field, why)


# ---------------------------------------------------------------------------- prefix-cache keys

def test_block_hashes_are_sha256_with_a_root_drawn_per_process():
    tokens = list(range(32))
    here = full_block_hashes(tokens, 16, 2)
    assert here == full_block_hashes(tokens, 16, 2) and len(here[0]) == 32
    assert full_block_hashes(tokens, 16, 2, cache_salt="a")[0] != here[0]
    code = "from scheduler.block_pool import full_block_hashes as f; print(f(list(range(32)), 16, 2)[0].hex())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() != here[0].hex()


def test_a_salted_request_hits_only_blocks_of_its_own_salt():
    router = make_router()
    workers = with_workers(router, FakeWorker(128, block_size=4))
    system = list(range(1, 41))  # 10 full blocks
    out = {}
    for rid, salt, tail in (("a1", "a", 900), ("a2", "a", 901), ("b1", "b", 902), ("none", "", 903),
                            ("none2", "", 904)):
        add(router, rid, system + [tail], 5, cache_salt=salt)
        run(router, workers, out)  # run() checks the block invariant after every step
        assert out[(rid, 0)]["tokens"] == reference_output(system + [tail], 5)
    cached = {rid: out[(rid, 0)]["cached"] for rid in ("a1", "a2", "b1", "none", "none2")}
    print(f"\ncached prompt tokens by salt: {cached}")
    assert cached == {"a1": 0, "a2": 40, "b1": 0, "none": 0, "none2": 40}
    kv = router.workers[b"w0"].scheduler.kv
    assert kv.num_free == kv.num_blocks


# ---------------------------------------------------------------------------- API keys and TLS

def _self_signed(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return str(cert), str(key)


def _code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_api_keys_tls_and_aborts_within_a_tenant(tmp_path):
    cert, key = _self_signed(tmp_path)

    async def serve(ready, stop):
        scheduler = FakeScheduler(TOK)
        scheduler.plan = lambda add: [None]  # every request runs until aborted
        gateway = Gateway(TOK, scheduler.address, port=0, api_keys=("key-a", "key-b"),
                          ssl=(cert, key))
        port = await gateway.start()
        await until(lambda: workers_of(gateway.client) >= 1)
        ready.append(port)
        while not stop:
            await asyncio.sleep(0.05)
        await gateway.stop(0.5)
        await scheduler.close()

    import threading
    ready, stop = [], []
    thread = threading.Thread(target=lambda: asyncio.run(serve(ready, stop)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not ready and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready, "the gateway did not start"
    target = f"127.0.0.1:{ready[0]}"
    creds = grpc.ssl_channel_credentials(root_certificates=open(cert, "rb").read())
    try:
        with grpc.secure_channel(target, creds) as ch, grpc.insecure_channel(target) as plain:
            stub = pagoda_pb2_grpc.GenerationStub(ch)
            a = [("authorization", "Bearer key-a")]
            b = [("authorization", "Bearer key-b")]
            req = pb.GenerateRequest(prompt="hi", request_id="job-1")
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # open without a key
            codes = {
                "no key": _code(lambda: stub.Generate(req, timeout=5)),
                "wrong key": _code(lambda: stub.Generate(req, timeout=5, metadata=[
                    ("authorization", "Bearer nope")])),
                "stream, no key": _code(lambda: list(stub.GenerateStream(req, timeout=5))),
                "abort, no key": _code(lambda: stub.Abort(pb.AbortRequest(request_ids=["x"]), timeout=5)),
                "plaintext to TLS": _code(lambda: pagoda_pb2_grpc.GenerationStub(plain).Generate(
                    req, timeout=5, metadata=a)),
            }
            print(f"\npublic side: {({k: v.name for k, v in codes.items()})}")
            assert codes == {"no key": grpc.StatusCode.UNAUTHENTICATED,
                             "wrong key": grpc.StatusCode.UNAUTHENTICATED,
                             "stream, no key": grpc.StatusCode.UNAUTHENTICATED,
                             "abort, no key": grpc.StatusCode.UNAUTHENTICATED,
                             "plaintext to TLS": grpc.StatusCode.UNAVAILABLE}
            stream = stub.GenerateStream(req, timeout=20, metadata=a)  # held open until aborted
            time.sleep(0.5)
            # The same client id under another key is another request, and B cannot abort A's.
            other = stub.GenerateStream(req, timeout=20, metadata=b)
            time.sleep(0.5)
            by_b = stub.Abort(pb.AbortRequest(request_ids=["job-1", "ghost"]), timeout=5, metadata=b)
            assert list(by_b.request_ids) == ["job-1"]
            assert [r.finish_reason for r in other][-1] == pb.FINISH_REASON_ABORT
            by_b_again = stub.Abort(pb.AbortRequest(request_ids=["job-1"]), timeout=5, metadata=b)
            assert list(by_b_again.request_ids) == []  # A's job-1 is still running, untouched
            by_a = stub.Abort(pb.AbortRequest(request_ids=["job-1"]), timeout=5, metadata=a)
            assert list(by_a.request_ids) == ["job-1"]
            assert [r.finish_reason for r in stream][-1] == pb.FINISH_REASON_ABORT
    finally:
        stop.append(True)
        thread.join(10)
