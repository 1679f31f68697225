"""Fair sharing between tenants on the real stack (scheduler, gateway, a fake worker process), with
no quota set: a tenant alone takes every seat of the batch; when it floods the queue, another
tenant's requests start after at most two of the flood's each (start-time fair queuing,
scheduler/tenants.py), not after the whole flood, while the flood keeps every seat the other does
not use and every stream ends token-exact."""
from __future__ import annotations

import time

import grpc
import pytest

from proto import pagoda_pb2 as pb
from tests.cluster import wait_for
from tests.fake_cluster import FakeCluster
from tests.fake_worker import reference_output
from tests.streams import Stream

pytestmark = pytest.mark.integration

KEY_A, KEY_B = "tenant-a-secret", "tenant-b-secret"
AUTH_A, AUTH_B = (("authorization", f"Bearer {KEY_A}"),), (("authorization", f"Bearer {KEY_B}"),)
SEATS = 4       # --max-num-seqs of the one worker
FLOOD = 24      # tenant A's streams: 4 run, 20 wait
TOKENS = 30


def prompt(i: int) -> list[int]:
    return [40, 41, 42, i]


def stream(stub, i: int, auth) -> Stream:
    return Stream(stub, pb.GenerateRequest(prompt_token_ids=prompt(i), sampling=pb.SamplingParams(seed=i),
                                           stopping=pb.StoppingCriteria(max_tokens=TOKENS)),
                  metadata=auth)


def running_waiting(c: FakeCluster) -> tuple[int, int]:
    (load,) = c.stub.GetLoads(pb.GetLoadsRequest(), metadata=AUTH_A, timeout=5).workers
    return load.running, load.waiting


def first_token_at(s: Stream) -> float:
    return s.token_times[0] if s.token_times else float("inf")


def test_a_flooding_tenant_keeps_the_rest_and_another_starts_within_two_of_its_requests(tmp_path):
    with FakeCluster(tmp_path, scheduler_flags=["--max-num-seqs", str(SEATS)],
                     gateway_flags=["--api-key", KEY_A, "--api-key", KEY_B],
                     # Steps of 0.04 s: the 20 waiting stay queued 1.2 s while the first four run.
                     worker_flags=["--num-gpu-blocks-override", "4096", "--step-delay", "0.04"]) as c:
        c.start()
        # Alone, tenant A fills every seat.
        flood = [stream(c.stub, i, AUTH_A) for i in range(FLOOD)]
        assert wait_for(lambda: sum(bool(s.tokens) for s in flood) == SEATS, 20), c.log_tail()
        assert wait_for(lambda: running_waiting(c) == (SEATS, FLOOD - SEATS), 10), running_waiting(c)
        # Tenant B arrives behind 20 of A's waiting requests.
        sent = time.monotonic()
        others = [stream(c.stub, 100 + i, AUTH_B) for i in range(2)]
        for s in flood + others:
            s.join(60)
        assert [s.code for s in flood + others] == [grpc.StatusCode.OK] * (FLOOD + 2), \
            [s.details for s in flood + others if s.code != grpc.StatusCode.OK]
        for i, s in enumerate(flood):
            assert s.tokens == reference_output(prompt(i), TOKENS, seed=i)
        for i, s in enumerate(others):
            assert s.tokens == reference_output(prompt(100 + i), TOKENS, seed=100 + i)
        # B's k-th request waits for at most 2 (k + 1) of A's that were waiting when it came;
        # first come, first served it would wait for all 20.
        started = sorted(first_token_at(s) for s in flood if first_token_at(s) > sent)
        ahead = [sum(t < first_token_at(s) for t in started) for s in others]
        print(f"\ntenant B's 2 requests behind A's {FLOOD - SEATS} waiting: started after "
              f"{ahead} of them, {[round(first_token_at(s) - sent, 2) for s in others]} s")
        assert ahead[0] <= 2 and ahead[1] <= 4, ahead
        assert wait_for(c.idle_and_free, 10), c.scheduler_metrics()


def test_a_tenant_that_fills_the_whole_queue_gives_way_to_another(tmp_path):
    """Tenant A alone fills every seat and the whole waiting queue; its next request is refused.
    Tenant B's two then take the places of A's two newest waiting ones, which end
    RESOURCE_EXHAUSTED saying so, and start before the rest of A's queue."""
    waiting = 8
    with FakeCluster(tmp_path, scheduler_flags=["--max-num-seqs", str(SEATS),
                                                "--max-waiting-requests", str(waiting)],
                     gateway_flags=["--api-key", KEY_A, "--api-key", KEY_B],
                     # Steps of 0.1 s: A's waiting requests stay queued for 3 s while the first
                     # four run, long enough for GetLoads to see them on a loaded machine.
                     worker_flags=["--num-gpu-blocks-override", "4096", "--step-delay", "0.1"]) as c:
        c.start()
        flood = [stream(c.stub, i, AUTH_A) for i in range(SEATS)]  # those run first, then
        assert wait_for(lambda: sum(bool(s.tokens) for s in flood) == SEATS, 20), c.log_tail()
        flood += [stream(c.stub, i, AUTH_A) for i in range(SEATS, SEATS + waiting)]  # these wait
        assert wait_for(lambda: running_waiting(c) == (SEATS, waiting), 10), running_waiting(c)
        more = stream(c.stub, 50, AUTH_A)
        more.join(30)
        assert more.code == grpc.StatusCode.RESOURCE_EXHAUSTED, more.details
        sent = time.monotonic()
        others = [stream(c.stub, 100 + i, AUTH_B) for i in range(2)]
        for s in flood + others:
            s.join(60)
        assert [s.code for s in others] == [grpc.StatusCode.OK] * 2, [s.details for s in others]
        for i, s in enumerate(others):
            assert s.tokens == reference_output(prompt(100 + i), TOKENS, seed=100 + i)
        pushed = [s for s in flood if s.code != grpc.StatusCode.OK]
        assert len(pushed) == 2 and all(
            s.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not s.tokens
            and s.details.startswith("the waiting queue is full and another tenant's request")
            for s in pushed), [(s.code, s.details) for s in pushed]
        for i, s in enumerate(flood):
            if s not in pushed:
                assert s.tokens == reference_output(prompt(i), TOKENS, seed=i)
        started = sorted(first_token_at(s) for s in flood if sent < first_token_at(s) < float("inf"))
        ahead = [sum(t < first_token_at(s) for t in started) for s in others]
        assert ahead[0] <= 2 and ahead[1] <= 4, ahead
        assert wait_for(c.idle_and_free, 10), c.scheduler_metrics()
