"""Per-tenant quotas at the scheduler (--max-seqs-per-tenant): one tenant cannot fill the queue
every tenant shares, and whatever way a request ends gives its tenant's room back."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from proto import internal_pb2 as pb, pagoda_pb2
from scheduler.beam_search import BeamSearch
from scheduler.request import Request, Status
from scheduler.router import Rejected
from scheduler.tenants import TenantLoad
from tests.fake_worker import FakeWorker, reference_output
from tests.unit.scheduler.test_scheduler import GW, check, make_router, run, step, with_workers


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


def test_a_full_queue_refuses_the_tenant_that_fills_it_and_pushes_out_for_another():
    """Without a quota a lone tenant may fill the whole waiting queue; another tenant's request
    then takes the place of the first's newest, until both hold as many."""
    router = make_router(max_waiting_requests=5)
    workers = with_workers(router, FakeWorker(256))
    for i in range(5):
        add(router, f"r{i}", "ka/")
    with pytest.raises(Rejected) as e:
        add(router, "r5", "ka/")
    assert e.value.message.startswith("the waiting queue is full (5 waiting")
    add(router, "b0", "kb/")  # r4 makes room
    check(router)
    add(router, "b1", "kb/")  # r3: a keeps 3, b holds 2
    check(router)
    with pytest.raises(Rejected) as e:
        add(router, "b2", "kb/")  # b would hold more than a
    assert e.value.message.startswith("the waiting queue is full (5 waiting")
    out = {}
    run(router, workers, out)
    pushed = {rid for (rid, _), o in out.items() if o["error"]}
    assert pushed == {"r3", "r4"}
    assert out[("r4", 0)]["error"] == "RESOURCE_EXHAUSTED"
    assert out[("r4", 0)]["message"].startswith("the waiting queue is full and another tenant's")
    for rid in ("r0", "r1", "r2", "b0", "b1"):
        assert out[(rid, 0)]["tokens"] == reference_output([3, 4, 5], 6)
    assert router.tenants.in_flight == {}


def test_a_beam_search_counts_its_width_against_the_quota():
    router = make_router(max_seqs_per_tenant=4)
    workers = with_workers(router, FakeWorker(256))
    router.add(GW, pb.AddRequest(request_id="beam", prompt_token_ids=[3, 4, 5], max_tokens=6,
                                 sampling=pb.SamplingConfig(), tenant="ka/",
                                 beam_search=pagoda_pb2.BeamSearchParams(beam_width=3)))
    assert router.tenants.in_flight["ka/"] == 3
    add(router, "one", "ka/")
    with pytest.raises(Rejected) as e:
        add(router, "two", "ka/")
    assert e.value.message.startswith("this tenant has 4 sequences in flight")
    run(router, workers, {})
    assert router.tenants.in_flight == {}


def first_token_order(router, workers) -> list[str]:
    """Request ids in the order their first tokens came out."""
    order, out = [], {}
    while step(router, workers, out):
        for (rid, _), o in out.items():
            if o["tokens"] and rid not in order:
                order.append(rid)
    return order


def test_a_flooding_tenant_queues_behind_itself_and_a_lone_one_takes_every_seat():
    router = make_router(max_num_seqs=2)
    workers = with_workers(router, FakeWorker(256))
    for i in range(8):
        add(router, f"a{i}", "ka/", max_tokens=4)
    add(router, "b0", "kb/", max_tokens=4)
    add(router, "b1", "kb/", max_tokens=4)
    # b0 goes right after the head of a's line, b1 after a's next: fair turns, not a's 8 first.
    assert first_token_order(router, workers)[:4] == ["a0", "b0", "a1", "b1"]
    assert router.tenants.in_flight == {}
    # Alone, a tenant fills every seat of the batch, in its own order.
    for i in range(4):
        add(router, f"c{i}", "ka/", max_tokens=4)
    (state,) = router.workers.values()
    plans = router.plans()
    assert [s.seq_id for _, p in plans for s in p.new_seqs] == ["c0#0", "c1#0"]
    assert state.scheduler.num_waiting == 2


def test_an_idle_tenant_banks_no_credit():
    """A tenant that sent nothing for a while starts at the head of the line, not before it."""
    router = make_router(max_num_seqs=1)
    workers = with_workers(router, FakeWorker(256))
    for i in range(3):
        add(router, f"a{i}", "ka/", max_tokens=4)
    run(router, workers, {})
    for i in range(3):
        add(router, f"b{i}", "kb/", max_tokens=4)
    add(router, "a3", "ka/", max_tokens=4)
    assert first_token_order(router, workers) == ["b0", "a3", "b1", "b2"]


def in_flight_by_tenant(router) -> dict[str, int]:
    """What the quota should count: each request's sequences (a beam search its width)."""
    held: dict[str, int] = {}
    for seqs in router.seqs.values():
        group = seqs[0].group
        held[seqs[0].tenant] = held.get(seqs[0].tenant, 0) + (
            group.seats if isinstance(group, BeamSearch) else len(seqs))
    return held


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "add_n", "beam", "step", "abort"]),
                              st.sampled_from(["ka/", "kb/", "kc/"]), st.integers(0, 10 ** 6)),
                    min_size=1, max_size=50))
def test_quotas_push_outs_and_fair_order_keep_the_books_and_the_blocks(ops):
    router = make_router(max_num_seqs=4, max_waiting_requests=6, max_seqs_per_tenant=7)
    workers = with_workers(router, FakeWorker(40, block_size=4))
    out, ids = {}, []
    for op, tenant, x in ops:
        rid = f"r{len(ids)}"
        try:
            if op == "beam":
                router.add(GW, pb.AddRequest(
                    request_id=rid, prompt_token_ids=[3, 4, x % 100 + 1], max_tokens=4,
                    sampling=pb.SamplingConfig(), tenant=tenant,
                    beam_search=pagoda_pb2.BeamSearchParams(beam_width=2 + x % 2)))
            elif op in ("add", "add_n"):
                add(router, rid, tenant, n=2 + x % 2 if op == "add_n" else 1, max_tokens=1 + x % 6)
            ids.append(rid)
        except Rejected as e:
            assert e.code == "RESOURCE_EXHAUSTED", e.message
        if op == "step":
            step(router, workers, out)
        elif op == "abort" and ids:
            router.abort(ids[x % len(ids)])
        check(router)
        assert router.tenants.in_flight == in_flight_by_tenant(router)
        assert all(v <= 7 for v in router.tenants.in_flight.values())
    run(router, workers, out)
    assert router.tenants.in_flight == {} and router.seqs == {}
    (state,) = router.workers.values()
    assert state.scheduler.kv.num_free == state.scheduler.kv.num_blocks
    for (rid, _), entry in out.items():  # nothing ends in error but a push-out
        assert entry["error"] in ("", "RESOURCE_EXHAUSTED"), entry


def test_a_tenants_line_keeps_no_ended_requests_behind_one_that_still_waits():
    """The line of a tenant whose oldest request waits (say, for a grammar) while its later ones
    run and end holds at most about twice what the tenant has in flight."""
    load = TenantLoad(0)

    def request(rid: str) -> Request:
        req = Request(seq_id=f"{rid}#0", request_id=rid, index=0, gateway=GW, prompt_token_ids=[1],
                      sampling=pb.SamplingConfig(), max_tokens=1, tenant="ka/")
        req.arrival = load.tag("ka/", 1)
        load.admit(req, 1)
        return req

    held = request("held")
    for i in range(200):
        request(f"r{i}").status = Status.FINISHED
        load.release("ka/", 1)
        assert len(load.lines["ka/"]) <= 2 * 2 + 8  # twice its most in flight (2), plus 8
    assert load.head() == held.arrival  # the one that waits is still the head of the line
