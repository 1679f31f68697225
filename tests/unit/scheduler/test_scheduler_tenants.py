"""Per-tenant quotas at the scheduler (--max-seqs-per-tenant): one tenant cannot fill the queue
every tenant shares, and whatever way a request ends gives its tenant's room back."""
from __future__ import annotations

import pytest

from proto import internal_pb2 as pb
from scheduler.router import Rejected
from tests.fake_worker import FakeWorker, reference_output
from tests.unit.scheduler.test_scheduler import GW, make_router, run, with_workers


def add(router, rid, tenant, n=1, max_tokens=6):
    router.add(GW, pb.AddRequest(request_id=rid, prompt_token_ids=[3, 4, 5], max_tokens=max_tokens,
                                 n=n, sampling=pb.SamplingConfig(), tenant=tenant))


def test_a_tenant_at_its_quota_is_refused_while_others_are_admitted():
    router = make_router(max_seqs_per_tenant=4, max_waiting_requests=100)
    workers = with_workers(router, FakeWorker(256))
    add(router, "a1", "ka/", n=3)
    add(router, "a2", "ka/")
    with pytest.raises(Rejected) as e:
        add(router, "a3", "ka/")
    assert e.value.code == "RESOURCE_EXHAUSTED"
    assert e.value.message.startswith("this tenant has 4 sequences in flight and may have at most 4")
    with pytest.raises(Rejected):
        add(router, "a4", "ka/", n=2)
    for i in range(4):  # another tenant has its own room
        add(router, f"b{i}", "kb/")
    out = {}
    run(router, workers, out)
    assert out[("b3", 0)]["tokens"] == reference_output([3, 4, 5], 6)
    assert router.tenants.in_flight == {}  # finished: every tenant's room is back
    add(router, "a5", "ka/", n=4)           # and tenant a may fill it again


def test_aborts_and_a_lost_gateway_give_the_room_back():
    router = make_router(max_seqs_per_tenant=2)
    with_workers(router, FakeWorker(256))
    add(router, "x", "ka/", n=2)
    router.abort("x", indices=(0,))
    assert router.tenants.in_flight["ka/"] == 2  # one sequence still runs
    router.abort("x", indices=(1,))
    assert "ka/" not in router.tenants.in_flight
    add(router, "y", "ka/", n=2)
    router.abort_gateway(GW, pb.Error(code="UNAVAILABLE", message="gone"))
    assert router.tenants.in_flight == {}


def test_without_a_quota_only_the_waiting_bound_applies():
    router = make_router(max_waiting_requests=5)
    with_workers(router, FakeWorker(256))
    for i in range(5):
        add(router, f"r{i}", "ka/")
    with pytest.raises(Rejected) as e:
        add(router, "r5", "kb/")
    assert e.value.message.startswith("the waiting queue is full")
