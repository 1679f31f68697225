"""Internal keys bound to roles (proto/auth.py, proto/keyset.py), on real ZeroMQ sockets with real
CURVE: each of the real scheduler's sockets lets in its own role's keys only; secret files are
0600; concurrent creators and readers of one keys directory all see one complete set; and
--insecure's loopback test parses the address."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from proto import internal_pb2 as ipb
from proto.auth import PROTOCOL_VERSION, CurveServer, check_auth_args, create_keys, secure_client
from proto.keyset import KeySet
from proto.loopback import is_loopback
from scheduler.scheduler_flags import add_scheduler_args
from scheduler.server import SchedulerServer
from tests.cluster import ROOT, free_port

# ---------------------------------------------------------------------------- roles on sockets

_HANDSHAKE = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH


def _peer(ctx, address, keys_dir, role, own_keys=None):
    """A DEALER with role's keys (or another key pair), and a monitor of its handshake."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, keys_dir, role)
    if own_keys is not None:
        sock.curve_publickey, sock.curve_secretkey = own_keys
    monitor = sock.get_monitor_socket(_HANDSHAKE)
    sock.connect(address)
    return sock, monitor


def _handshake(monitor, timeout=5.0) -> str:
    deadline = time.monotonic() + timeout
    while monitor.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        event = recv_monitor_message(monitor)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return "accepted"
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return "refused"
    return "no answer"


def _worker_hello(worker_id: str) -> bytes:
    return ipb.WorkerMessage(hello=ipb.WorkerHello(
        worker_id=worker_id, model="SmolLM2-135M-Instruct", num_blocks=64, block_size=16,
        max_model_len=2048, vocab_size=49152, device="cpu", eos_token_ids=[2],
        protocol_version=PROTOCOL_VERSION)).SerializeToString()


def _add(request_id: str) -> bytes:
    return ipb.GatewayMessage(add=ipb.AddRequest(
        request_id=request_id, prompt_token_ids=[1, 2, 3], max_tokens=4)).SerializeToString()


def _scheduler(keys: Path) -> SchedulerServer:
    args = add_scheduler_args(argparse.ArgumentParser()).parse_args([
        "--scheduler-gateway-address", f"tcp://127.0.0.1:{free_port()}",
        "--scheduler-worker-address", f"tcp://127.0.0.1:{free_port()}",
        "--zmq-keys-dir", str(keys)])
    check_auth_args(args, role="scheduler")
    return SchedulerServer(args)


def _received(server: SchedulerServer, expected: int, quiet_s: float = 1.0) -> dict[str, list]:
    """Every payload the scheduler's two sockets receive, until `expected` have come and then
    nothing more for quiet_s."""
    got: dict[str, list] = {"gateway socket": [], "worker socket": []}
    poller = zmq.Poller()
    sockets = {server.gateways: "gateway socket", server.workers: "worker socket"}
    for sock in sockets:
        poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + 10
    quiet_until = None
    while time.monotonic() < (quiet_until or deadline):
        for sock, _ in poller.poll(100):
            got[sockets[sock]].append(sock.recv_multipart()[-1])
        if quiet_until is None and sum(map(len, got.values())) >= expected:
            quiet_until = time.monotonic() + quiet_s
    return got


def test_each_scheduler_socket_lets_in_its_own_roles_keys_and_no_other(tmp_path):
    """The audit's attacks on the real SchedulerServer's sockets: the gateway's key says a
    worker's hello on the worker socket (it would then be sent every tenant's prompts), the
    worker's key adds a request on the gateway socket. Both fail the handshake and the
    scheduler receives nothing from them; each role's own key, and a second worker's own key
    pair in authorized/worker/, get through."""
    keys = create_keys(tmp_path / "keys")
    public, _ = zmq.auth.create_certificates(str(tmp_path), "worker-2")
    shutil.copyfile(public, keys / "authorized" / "worker" / "worker-2.key")
    second_worker = zmq.auth.load_certificate(str(tmp_path / "worker-2.key_secret"))
    server = _scheduler(keys)
    gw_address = server.args.scheduler_gateway_address
    wk_address = server.args.scheduler_worker_address
    ctx = zmq.Context()
    peers = {}
    try:
        plan = {  # name: (address, role of the keys, payload)
            "gateway key on the worker socket": (wk_address, "gateway", _worker_hello("intruder-gw")),
            "worker key on the gateway socket": (gw_address, "worker", _add("intruder-wk")),
            "gateway key on the gateway socket": (gw_address, "gateway", _add("tenant-1")),
            "worker key on the worker socket": (wk_address, "worker", _worker_hello("worker-1")),
        }
        for name, (address, role, payload) in plan.items():
            peers[name] = _peer(ctx, address, keys, role)
            peers[name][0].send(payload)
        peers["second worker's own key"] = _peer(ctx, wk_address, keys, "worker", second_worker)
        peers["second worker's own key"][0].send(_worker_hello("worker-2"))
        outcome = {name: _handshake(monitor) for name, (_, monitor) in peers.items()}
        got = _received(server, expected=3)
        print(f"\nhandshakes: {outcome}\nthe scheduler received: "
              f"{ {k: len(v) for k, v in got.items()} } messages")
        assert outcome == {"gateway key on the worker socket": "refused",
                           "worker key on the gateway socket": "refused",
                           "gateway key on the gateway socket": "accepted",
                           "worker key on the worker socket": "accepted",
                           "second worker's own key": "accepted"}
        # The two workers connect side by side: their hellos arrive in either order.
        assert {k: sorted(v) for k, v in got.items()} == {
            "gateway socket": [_add("tenant-1")],
            "worker socket": sorted([_worker_hello("worker-1"), _worker_hello("worker-2")])}
        # and nothing ever comes back to the refused peers
        for name in ("gateway key on the worker socket", "worker key on the gateway socket"):
            assert not peers[name][0].poll(200), name
    finally:
        for sock, monitor in peers.values():
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
        ctx.term()
        server._shutdown()


def test_a_scheduler_socket_serves_one_client_role():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        for role in ("scheduler", "", "*"):
            with pytest.raises(ValueError, match="one of gateway, worker"):
                CurveServer(ctx, None).secure(sock, role)
        with pytest.raises(ValueError, match="one of gateway, worker"):
            secure_client(sock, "/nonexistent", "scheduler")
    finally:
        sock.close(0)
        ctx.term()


# ---------------------------------------------------------------------------- files on disk


def test_secret_files_are_0600_and_the_directory_0700_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        keys = create_keys(tmp_path / "keys")
    finally:
        os.umask(old)
    secrets = sorted(keys.glob("*.key_secret"))
    assert [p.name for p in secrets] == ["gateway.key_secret", "scheduler.key_secret",
                                         "worker.key_secret"]
    assert {p.name: p.stat().st_mode & 0o777 for p in secrets} == {p.name: 0o600 for p in secrets}
    assert keys.stat().st_mode & 0o777 == 0o700


def test_a_set_is_kept_once_made_and_each_role_finds_what_it_loads(tmp_path):
    keys = create_keys(tmp_path / "keys")
    before = _digests(keys)
    assert create_keys(keys) == keys and _digests(keys) == before
    for role in ("scheduler", "gateway", "worker"):
        check_auth_args(argparse.Namespace(zmq_keys_dir=str(keys), insecure=False), role=role)
    # a worker host's copy: its own pair's secret and the scheduler's public key, nothing else
    worker_only = tmp_path / "worker-host"
    worker_only.mkdir()
    for name in ("worker.key_secret", "scheduler.key"):
        shutil.copyfile(keys / name, worker_only / name)
    args = argparse.Namespace(zmq_keys_dir=str(worker_only), insecure=False)
    check_auth_args(args, role="worker")
    check_auth_args(args)  # the gateway's call: the scheduler's public key is there
    with pytest.raises(SystemExit, match="no gateway.key_secret there"):
        check_auth_args(args, role="gateway")
    with pytest.raises(SystemExit, match="no scheduler.key_secret, authorized/gateway, authorized/worker"):
        check_auth_args(args, role="scheduler")


def test_a_set_of_the_old_layout_is_refused_with_what_to_do_and_left_as_it_was(tmp_path):
    old = tmp_path / "keys"
    (old / "authorized").mkdir(parents=True)
    for name in ("scheduler", "gateway", "worker"):
        public, _ = zmq.auth.create_certificates(str(old), name)
        if name != "scheduler":
            shutil.copyfile(public, old / "authorized" / f"{name}.key")
    before = _digests(old)
    with pytest.raises(SystemExit, match=r"not a complete CURVE key set \(missing "
                       r"authorized/gateway/gateway.key, authorized/worker/worker.key.*move it aside"):
        create_keys(old)
    assert _digests(old) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys"]  # no staging left behind
    with pytest.raises(SystemExit, match="no authorized/gateway, authorized/worker there"):
        check_auth_args(argparse.Namespace(zmq_keys_dir=str(old), insecure=False), role="scheduler")


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# Creators make the set; readers look at the directory from before the creators start until
# they find it non-empty, counting each look that found files but not a complete set.
_RACER = r"""
import hashlib, json, sys, time
from pathlib import Path
from proto.keyset import KeySet
root, start, job = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
keys = KeySet(root)
time.sleep(max(0.0, start - time.time() - (0.05 if job == "read" else 0.0)))
torn = looks = 0
if job == "create":
    while time.time() < start:
        pass  # spin: the creators leave together
    keys.create()
else:
    deadline = time.time() + 30
    while time.time() < deadline:
        looks += 1
        if root.is_dir() and any(root.iterdir()):
            if not keys.missing():
                break
            torn += 1
digests = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
           for p in sorted(root.rglob("*")) if p.is_file()}
print(json.dumps({"torn": torn, "looks": looks, "digests": digests}))
"""


@pytest.mark.parametrize("before", ["absent", "an empty directory"])
def test_concurrent_creators_and_readers_all_see_one_complete_set(tmp_path, before):
    """Six processes create the same keys directory at the same instant while three read it
    (the launcher and a test, two launchers; "an empty directory" is tests/fake_cluster.py's
    mkdtemp). Every one sees the same complete set, and no reader ever a partial one."""
    root = tmp_path / "keys"
    if before == "an empty directory":
        root.mkdir()
    start = time.time() + 3.0  # every interpreter is up by then (9 imports of zmq, 2 cores)
    jobs = ["create"] * 6 + ["read"] * 3
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(root), repr(start), job], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for job in jobs]
    results = []
    for job, proc in zip(jobs, procs):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        results.append((job, json.loads(out)))
    final = _digests(root)
    whole_set = {*(f"{n}.key{s}" for n in ("scheduler", "gateway", "worker") for s in ("", "_secret")),
                 "authorized/gateway/gateway.key", "authorized/worker/worker.key"}
    print(f"\n{before}: {len(jobs)} processes; readers' looks "
          f"{[r['looks'] for j, r in results if j == 'read']}, torn views "
          f"{sum(r['torn'] for _, r in results)}")
    assert set(final) == whole_set
    assert [r["digests"] for _, r in results] == [final] * len(jobs)
    assert [r["torn"] for _, r in results] == [0] * len(jobs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys"]  # no staging left behind


# ---------------------------------------------------------------------------- --insecure

LOOPBACK = [
    "tcp://127.0.0.1:5555", "tcp://127.255.255.254:1", "tcp://127.0.0.1:*", "tcp://localhost:5555",
    "tcp://[::1]:5555", "ipc:///tmp/pagoda.sock", "ipc://@pagoda", "inproc://scheduler",
]
NOT_LOOPBACK = [
    "tcp://127.evil.example:5555", "tcp://127.0.0.1.evil.example:5555",
    "tcp://localhost.evil.example:5555", "tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.0.0.1:5555",
    "tcp://[::]:5555", "tcp://[::ffff:127.0.0.1]:5555", "tcp://::1:5555", "tcp://[127.0.0.1]:5555",
    "tcp://[::1%lo]:5555", "tcp://127.1:5555", "tcp://lo:5555", "tcp://127.0.0.1",
    "tcp://127.0.0.1:", "tcp://127.0.0.1:99999", "tcp://127.0.0.1:55\u00b2",
    "tcp://eth0;127.0.0.1:5555", "tcp://127.0.0.1:5555;10.0.0.1:5555", "udp://127.0.0.1:5555",
    "ws://127.0.0.1:5555", "TCP://127.0.0.1:5555", "ipc://", "127.0.0.1:5555", "",
]


@pytest.mark.parametrize("address,expected", [(a, True) for a in LOOPBACK]
                         + [(a, False) for a in NOT_LOOPBACK])
def test_the_loopback_check_parses_the_address(address, expected):
    assert is_loopback(address) is expected


def test_insecure_refuses_a_look_alike_of_loopback_by_name():
    args = argparse.Namespace(zmq_keys_dir=None, insecure=True)
    check_auth_args(args, "tcp://127.0.0.1:5555", "tcp://[::1]:5556", "ipc:///tmp/x")
    with pytest.raises(SystemExit, match=r"--insecure is for loopback only, not "
                       r"tcp://127\.evil\.example:5555 \(loopback here: tcp:// to 127\.0\.0\.0/8"):
        check_auth_args(args, "tcp://127.0.0.1:5555", "tcp://127.evil.example:5555")
