"""Starts the real processes (through the launcher, as `make run` does) on free loopback ports."""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from process_life.lifetime import PARENT_ENV
from proto.auth import create_keys

ROOT = Path(__file__).resolve().parent.parent


# A test's channel is often opened before its server listens: without these, gRPC's reconnect
# backoff (1 s, then 1.6x) would make every start wait a second or two after the server is up.
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                  ("grpc.max_reconnect_backoff_ms", 500)]


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now and not handed out before in this process (the kernel may offer a port
    again once its socket is closed, and one cluster asks for five)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def temporary_keys() -> Path:
    """A fresh key set in /tmp, removed when the test process ends (a stack may be stopped and
    started again, so not at its stop): every stack of a suite left one behind before."""
    keys = create_keys(tempfile.mkdtemp(prefix="pagoda-keys-"))
    atexit.register(shutil.rmtree, keys, True)
    return keys


def read_metrics(port: int) -> dict[str, float]:
    """A Prometheus /metrics page on loopback as {name with labels: value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def sum_metric(metrics: dict[str, float], name: str) -> float:
    """One metric summed over its labels (over workers, for the scheduler's)."""
    return sum(v for k, v in metrics.items() if k.split("{")[0] == name)


class LoopbackStack:
    """What every stack of the tests answers on: its gRPC port, its HTTP port and its
    scheduler's /metrics page, all on loopback (Cluster, and tests/fake_cluster.py's FakeCluster)."""
    grpc_port: int
    http_port: int
    metrics_port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible API (a FakeCluster's with http=True), as the `openai` client
        takes it."""
        return f"http://127.0.0.1:{self.http_port}/v1"

    def scheduler_metrics(self) -> dict[str, float]:
        return read_metrics(self.metrics_port)

    def metric(self, name: str) -> float:
        """Summed over workers."""
        return sum_metric(self.scheduler_metrics(), name)


class Cluster(LoopbackStack):
    def __init__(self, *flags: str, num_workers: int = 1, log_path: Path | None = None,
                 lazy_grammar: bool = True) -> None:
        self.grpc_port = free_port()
        self.metrics_port = free_port()
        self.gateway_metrics_port = free_port()
        self.http_port = free_port()
        self.gateway_address = f"tcp://127.0.0.1:{free_port()}"
        self.worker_address = f"tcp://127.0.0.1:{free_port()}"
        # Authenticated, as `make run` is: every test exercises the CURVE path.
        self.keys_dir = None if "--insecure" in flags else temporary_keys()
        self.flags = [
            "--num-workers", str(num_workers),
            "--port", str(self.grpc_port),
            "--http-port", str(self.http_port),
            "--scheduler-gateway-address", self.gateway_address,
            "--scheduler-worker-address", self.worker_address,
            *(["--zmq-keys-dir", str(self.keys_dir)] if self.keys_dir else []),
            "--scheduler-metrics-port", str(self.metrics_port),
            "--gateway-metrics-port", str(self.gateway_metrics_port),
            # The gateway's grammar check starts its child (seconds of CPU, which readiness waits
            # for) only when a structured request needs it: tests start many stacks, and only a
            # few send one. Benchmarks pass lazy_grammar=False, as a user runs it.
            *(["--structured-outputs-lazy"] if lazy_grammar else []),
            *flags,
        ]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> "Cluster":
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "launch", *self.flags], cwd=ROOT,
                                     stdout=log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1",
                                              **{PARENT_ENV: str(os.getpid())}),
                                     start_new_session=True)
        try:
            self.wait_serving(timeout)
        except Exception:
            print(self.log_tail())  # pytest shows it with the failure
            self.stop()
            raise
        return self

    def log_tail(self, chars: int = 5000) -> str:
        return self.log_path.read_text()[-chars:] if self.log_path else ""

    def wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.target, options=FAST_RECONNECT) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"launcher exited with {self.proc.returncode}; see {self.log_path}")
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)  # a stack comes up in about 3 s: a coarser poll would add to every start
        raise TimeoutError(f"not SERVING after {timeout}s; see {self.log_path}")

    def wait_for_workers(self, n: int, timeout: float = 300) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.metric("pagoda_kv_blocks_total") and sum(
                    1 for k in self.scheduler_metrics() if k.startswith("pagoda_kv_blocks_total{")) >= n:
                return True
            time.sleep(0.5)
        return False

    def stop(self) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                return -9
        return self.proc.returncode if self.proc else 0
