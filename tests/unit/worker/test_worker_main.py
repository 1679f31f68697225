"""worker.main as a real process against a ROUTER socket playing the scheduler."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from proto import internal_pb2
from proto.columns import unpack_list
from tests.worker_tiny_models import make_hf_model, save_model

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_model(make_hf_model("llama"), tmp_path_factory.mktemp("main-model"))


@pytest.fixture
def scheduler_socket():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(0)
    ctx.term()


def start_worker(model: Path, address: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "worker.main", "--model", str(model), "--dtype", "float32",
           "--device", "cpu", "--num-gpu-blocks-override", "16", "--max-num-batched-tokens", "32",
           "--scheduler-worker-address", address, "--worker-id", "test-worker",
           "--insecure"]  # the ROUTER here plays the scheduler without CURVE
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def receive(sock: zmq.Socket, timeout_s: float = 60.0, skip_heartbeats: bool = True):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(int((deadline - time.monotonic()) * 1000) + 1):
            ident, data = sock.recv_multipart()
            msg = internal_pb2.WorkerMessage.FromString(data)
            if skip_heartbeats and msg.WhichOneof("kind") in ("heartbeat", "heartbeat_of"):
                continue
            return ident, msg
    raise TimeoutError("no message from the worker")


def send(sock, ident, **kind):
    sock.send_multipart([ident, internal_pb2.SchedulerToWorker(**kind).SerializeToString()])


def test_hello_plan_heartbeat_reregister_shutdown(tiny_model, scheduler_socket):
    sock, address = scheduler_socket
    proc = start_worker(tiny_model, address)
    try:
        ident, msg = receive(sock)
        assert msg.hello.worker_id == "test-worker" and msg.hello.num_blocks == 16

        plan = internal_pb2.StepPlan(step_id=3, new_seqs=[internal_pb2.NewSeq(
            seq_id="r1", slot=4, token_ids=[1, 2, 3, 4, 5], block_ids=[7], num_new_tokens=5)])
        send(sock, ident, plan=plan)
        _, msg = receive(sock)
        assert msg.result.step_id == 3 and unpack_list(msg.result.slots) == [4] and not msg.result.error

        # Idle: the main socket heartbeats within ~1 s, the heartbeat thread every 0.25 s.
        beats = [receive(sock, timeout_s=5, skip_heartbeats=False) for _ in range(8)]
        assert any(i == ident and m.heartbeat for i, m in beats)
        assert {m.heartbeat_of for i, m in beats if i != ident} == {ident}

        sock.send_multipart([ident, b"\xff\xfe not protobuf"])  # ignored, not fatal
        send(sock, ident, reregister=True)
        _, msg = receive(sock)
        assert msg.hello.worker_id == "test-worker"

        send(sock, ident, shutdown=True)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
    assert "Traceback" not in output, output
    frozen = re.search(r"(\d+) start-up objects frozen out of the garbage collector's passes", output)
    assert frozen and int(frozen[1]) > 10000, output  # torch and the model, before the hello


def test_sigterm_says_goodbye_and_exits_cleanly(tiny_model, scheduler_socket):
    sock, address = scheduler_socket
    proc = start_worker(tiny_model, address)
    try:
        receive(sock)
        proc.send_signal(signal.SIGTERM)
        _, msg = receive(sock, timeout_s=10)  # so the scheduler requeues its sequences at once
        assert msg.WhichOneof("kind") == "goodbye"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.parametrize("module", ["worker.main", "gateway.main"])
def test_a_model_that_is_not_there_exits_2_with_one_line(module):
    """As a container runs it (no launcher to check first): the flag named, no traceback, and
    argparse's exit code, which the launcher does not restart."""
    proc = subprocess.run([sys.executable, "-m", module, "--model", "/no/such/model.gguf", "--insecure"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "pagoda: --model '/no/such/model.gguf': no such file or directory (no model hub is reached)")
    assert "Traceback" not in proc.stderr
