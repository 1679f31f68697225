"""A worker on another host: the scheduler binds its worker socket on every interface
(`--scheduler-worker-address tcp://0.0.0.0:PORT`) and the worker connects to this machine's
non-loopback address, as one on another host would, with CURVE; the same connection without
keys is refused before the worker loads anything."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from proto import pagoda_pb2 as pb
from tests.cluster import ROOT, free_port, wait_for
from tests.fake_cluster import SERVING, FakeCluster


def host_address() -> str:
    """This machine's address on its default route (connecting a UDP socket sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address = s.getsockname()[0]
        except OSError:
            address = "127.0.0.1"
    if address.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address to connect through")
    return address


def test_a_worker_joins_a_scheduler_through_a_non_loopback_address(tmp_path):
    host, port = host_address(), free_port()
    with FakeCluster(tmp_path) as cluster:
        cluster.worker_address = f"tcp://0.0.0.0:{port}"  # what the scheduler binds
        cluster.start_scheduler()
        cluster.start_worker("--scheduler-worker-address", f"tcp://{host}:{port}",
                             "--worker-id", "remote-0")
        cluster.start_gateway()
        assert cluster.wait_health(SERVING, 60), cluster.log_tail()
        assert 'pagoda_kv_blocks_total{worker="remote-0"}' in cluster.scheduler_metrics()
        out = cluster.stub.Generate(pb.GenerateRequest(
            prompt_token_ids=[5, 6, 7], stopping=pb.StoppingCriteria(max_tokens=8)), timeout=30)
        assert len(out.token_ids) == 8
        assert wait_for(cluster.idle_and_free, 10), cluster.log_tail()


def test_a_worker_without_keys_is_refused_a_remote_address():
    address = f"tcp://{host_address()}:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "worker.main", "--scheduler-worker-address",
                           address, "--insecure"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert f"--insecure is for loopback only, not {address}" in proc.stderr
