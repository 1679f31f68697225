"""Two real workers; one is killed mid-stream. Its sequences are recomputed on the other from
prompt plus the tokens already streamed, so the client's stream continues unchanged."""
from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import Cluster

pytestmark = pytest.mark.integration


def busy_worker_pid(cluster: Cluster) -> int | None:
    for key, value in cluster.scheduler_metrics().items():
        if key.startswith("pagoda_num_requests_running{") and value > 0:
            worker_id = key.split('worker="')[1].split('"')[0]
            return int(worker_id.rsplit("-", 1)[1])  # default worker ids are <host>-<pid>
    return None


def test_killed_worker_streams_continue_on_the_other(tmp_path):
    log = tmp_path / "cluster.log"
    cluster = Cluster("--dtype", "float32", "--num-gpu-blocks-override", "256",
                      # Above a forward's time while the launcher's new worker loads beside it.
                      "--worker-timeout", "8", num_workers=2, log_path=log)
    try:
        cluster.start()
        assert cluster.wait_for_workers(2)
        req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="Tell me about rivers.")],
                                 sampling=pb.SamplingParams(temperature=0),
                                 stopping=pb.StoppingCriteria(max_tokens=40, ignore_eos=True))
        with grpc.insecure_channel(cluster.target) as ch:
            stub = pagoda_pb2_grpc.GenerationStub(ch)
            undisturbed = list(stub.Generate(req, timeout=300).token_ids)
            got, killed = [], None
            for msg in stub.GenerateStream(req, timeout=300):
                got += list(msg.token_ids)
                if killed is None and len(got) >= 8:
                    killed = busy_worker_pid(cluster)
                    assert killed is not None
                    os.kill(killed, signal.SIGKILL)
            assert killed is not None
            assert got == undisturbed
        # The dead worker's pool is dropped (the launcher starts a new worker, whose pool is
        # another), and every block of every pool is free again.
        dead = f'-{killed}"'
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(dead in k for k in cluster.scheduler_metrics()):
            time.sleep(0.5)
        assert not any(dead in k for k in cluster.scheduler_metrics())
        assert cluster.metric("pagoda_kv_blocks_free") == cluster.metric("pagoda_kv_blocks_total")
    finally:
        cluster.stop()
