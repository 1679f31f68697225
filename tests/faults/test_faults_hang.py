"""A worker whose forward hangs while its heartbeat thread beats on: the step deadline
(scheduler/deadlines.py) drops it, and its streams continue on the survivor token-exact. Real
scheduler and gateway processes, two fake worker processes (tests/fake_worker_main.py)."""
from __future__ import annotations

import time

import grpc
import pytest

from proto import pagoda_pb2 as pb
from tests.cluster import wait_for
from tests.fake_cluster import SERVING, FakeCluster
from tests.fake_worker import HANG_MARK, reference_output
from tests.streams import Stream

STEP_TIMEOUT = 2.0


def prompt(i: int) -> list[int]:
    # Hangs a --hang-on-mark worker once it has 20 + i output tokens.
    return [HANG_MARK, 20 + i, 30 + i, 40]


@pytest.mark.parametrize("hang", ["inf", "5"], ids=["forever", "5s-then-a-late-result"])
def test_a_hung_worker_is_dropped_and_the_survivor_finishes_token_exact(tmp_path, hang):
    cluster = FakeCluster(tmp_path, scheduler_flags=["--step-timeout", str(STEP_TIMEOUT)],
                          worker_flags=["--num-gpu-blocks-override", "4096", "--step-delay", "0.02"])
    try:
        cluster.start_scheduler()
        hung = cluster.start_worker("--hang-on-mark", hang)
        cluster.start_worker()
        cluster.start_gateway()
        assert cluster.wait_health(SERVING, 60), cluster.log_tail()
        assert wait_for(lambda: cluster.num_workers() == 2, 30), cluster.log_tail()
        streams = [Stream(cluster.stub, pb.GenerateRequest(
            prompt_token_ids=prompt(i), sampling=pb.SamplingParams(seed=i),
            stopping=pb.StoppingCriteria(max_tokens=80))) for i in range(8)]
        assert wait_for(lambda: all(len(s.tokens) >= 5 for s in streams), 30), cluster.log_tail()
        loads = cluster.stub.GetLoads(pb.GetLoadsRequest(), timeout=5)
        assert sorted(w.running for w in loads.workers) == [4, 4]  # both hold streams
        for s in streams:
            s.join(60)
        # The longest a stream waited for its next token: the hang, until the deadline dropped it.
        stall = max(max(b - a for a, b in zip(s.token_times, s.token_times[1:])) for s in streams)
        log = (tmp_path / "scheduler.log").read_text()
        print(f"\nworker hung (--hang-on-mark {hang}, heartbeats on): dropped by the step deadline "
              f"(--step-timeout {STEP_TIMEOUT:g}); its streams resumed on the survivor after at most "
              f"{stall:.2f} s, 8/8 token-exact")
        assert [s.code for s in streams] == [grpc.StatusCode.OK] * 8, [s.details for s in streams]
        for i, s in enumerate(streams):
            assert s.tokens == reference_output(prompt(i), 80, seed=i)
        assert "overdue" in log and "silent for" not in log
        assert STEP_TIMEOUT <= stall < STEP_TIMEOUT + 1.0
        if hang == "inf":
            assert hung.poll() is None  # alive, heartbeating, and dropped all the same
        else:
            # Its late results came from a worker the scheduler had dropped: ignored (the streams
            # above are exact, no token twice), and it was asked to register again.
            assert wait_for(lambda: cluster.num_workers() == 2, 15), cluster.log_tail()
            assert "saying hello again" in (tmp_path / "worker0.log").read_text()
        assert wait_for(cluster.idle_and_free, 10), cluster.scheduler_metrics()
        leaked = cluster.metric("pagoda_kv_blocks_total") - cluster.metric("pagoda_kv_blocks_free")
        print(f"at idle: {leaked:.0f} blocks leaked")
        assert leaked == 0
    finally:
        cluster.kill(cluster.workers[0] if cluster.workers else None)  # SIGTERM waits on a hang
        cluster.stop()
