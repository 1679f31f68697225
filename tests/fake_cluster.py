"""The real scheduler and gateway processes around fake worker processes (tests/fake_worker.py),
each started, killed and restarted on its own, on free loopback ports: for fault tests where the
model is not the point."""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import pagoda_pb2_grpc
from process_life.lifetime import PARENT_ENV
from tests.cluster import FAST_RECONNECT, ROOT, LoopbackStack, free_port, sum_metric, temporary_keys, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class FakeCluster(LoopbackStack):
    def __init__(self, log_dir: Path, scheduler_flags=(), gateway_flags=(), worker_flags=(),
                 http: bool = False, gateway_address_space: int | None = None,
                 worker_module: str = "tests.fake_worker_main", lazy_grammar: bool = True):
        self.log_dir = log_dir
        # --structured-outputs-lazy: the gateway's grammar check's child (seconds of CPU at each
        # of the many starts of fault tests) starts only when a structured request needs it
        self.lazy_grammar = lazy_grammar
        self.worker_module = worker_module  # e.g. tests.fake_worker_canned
        self.http_port = free_port() if http else 0
        # RLIMIT_AS of the gateway: a test of bounded memory fails with MemoryError in the gateway
        # instead of exhausting the machine when the bound regresses.
        self.gateway_address_space = gateway_address_space
        self.grpc_port, self.metrics_port = free_port(), free_port()
        self.gateway_address = f"tcp://127.0.0.1:{free_port()}"
        self.worker_address = f"tcp://127.0.0.1:{free_port()}"
        self.scheduler_flags, self.gateway_flags = list(scheduler_flags), list(gateway_flags)
        self.worker_flags = list(worker_flags)
        # Authenticated, as `make run` is (proto/auth.py).
        self.keys_flags = ["--zmq-keys-dir", str(temporary_keys())]
        self.scheduler: subprocess.Popen | None = None
        self.gateway: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.channel = grpc.insecure_channel(self.target, options=FAST_RECONNECT)
        self.stub = pagoda_pb2_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def _spawn(self, name: str, module: str, *flags: str,
               address_space: int | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", module, *flags], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1",
                                                                   **{PARENT_ENV: str(os.getpid())}))
        if address_space:
            # Set from outside, not in a preexec_fn: that makes subprocess fork this process,
            # whose gRPC threads' fork handlers can then hang the child before it execs.
            resource.prlimit(proc.pid, resource.RLIMIT_AS, (address_space, address_space))
        return proc

    def start_scheduler(self) -> None:
        self.scheduler = self._spawn(
            "scheduler", "scheduler.main", "--scheduler-gateway-address", self.gateway_address,
            "--scheduler-worker-address", self.worker_address,
            "--scheduler-metrics-port", str(self.metrics_port), *self.keys_flags,
            *self.scheduler_flags)

    def start_gateway(self) -> None:
        self.gateway = self._spawn(
            "gateway", "gateway.main", "--port", str(self.grpc_port), "--gateway-metrics-port", "0",
            "--http-port", str(self.http_port), "--scheduler-gateway-address", self.gateway_address,
            *(["--structured-outputs-lazy"] if self.lazy_grammar else []),
            *self.keys_flags, *self.gateway_flags, address_space=self.gateway_address_space)

    def start_worker(self, *flags: str) -> subprocess.Popen:
        proc = self._spawn(f"worker{len(self.workers)}", self.worker_module,
                           "--scheduler-worker-address", self.worker_address, "--block-size", "4",
                           *self.keys_flags, *self.worker_flags, *flags)
        self.workers.append(proc)
        return proc

    def __enter__(self) -> "FakeCluster":
        return self

    def __exit__(self, *exc_info) -> None:
        """`with FakeCluster(...) as cluster:` stops it however the block ends."""
        self.stop()

    def start(self, num_workers: int = 1, timeout: float = 60) -> "FakeCluster":
        try:
            self.start_scheduler()
            for _ in range(num_workers):
                self.start_worker()
            self.start_gateway()
            assert self.wait_health(SERVING, timeout), self.log_tail()
            assert wait_for(lambda: self.num_workers() == num_workers, timeout), self.log_tail()
        except BaseException:
            self.stop()  # a cluster that failed to start leaves no process behind
            raise
        return self

    def health_status(self) -> int | None:
        try:
            return self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
        except grpc.RpcError:
            return None

    def wait_health(self, status: int, timeout: float) -> bool:
        return wait_for(lambda: self.health_status() == status, timeout)

    def num_workers(self) -> int:
        try:
            return sum(1 for k in self.scheduler_metrics() if k.startswith("pagoda_kv_blocks_total{"))
        except OSError:
            return -1

    def idle_and_free(self) -> bool:
        """No sequence running or waiting anywhere, and every KV block free."""
        m = self.scheduler_metrics()
        total = lambda name: sum_metric(m, name)  # noqa: E731
        return (total("pagoda_num_requests_running") == 0 and total("pagoda_num_requests_waiting") == 0
                and total("pagoda_num_requests_swapped") == 0
                and total("pagoda_kv_blocks_free") == total("pagoda_kv_blocks_total"))

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}"
                         for p in sorted(self.log_dir.glob("*.log")))

    @staticmethod
    def kill(proc: subprocess.Popen | None) -> None:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        self.channel.close()
        for proc in [self.gateway, *self.workers, self.scheduler]:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in [self.gateway, *self.workers, self.scheduler]:
            if proc is None:
                continue
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(proc)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def children(pid: int, module: str) -> list[int]:
    """The processes whose parent is pid and whose command line runs `module`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == pid and module.encode() in cmdline:
            found.append(int(entry.name))
    return found
