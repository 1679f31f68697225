"""--max-step-failures, against in-process fake workers: a sequence whose running step is lost
with its worker (Router.remove with step_lost) on that many workers in a row ends with INTERNAL
and holds no block anywhere. An innocent neighbour of such a sequence finishes token-exact. A
sequence that got further between losses, or that was only in a plan queued behind the running
one, is recomputed as before (scheduler/lost_steps.py)."""
from __future__ import annotations

import pytest

from proto import internal_pb2 as pb, pagoda_pb2
from tests.fake_worker import FakeWorker, reference_output
from tests.unit.scheduler.test_scheduler import GW, add, check, collect, make_router, run, step, with_workers


def holder(router, seq_id: str) -> bytes:
    (wid,) = [w for w, s in router.workers.items()
              if seq_id in s.scheduler.requests or seq_id in s.scheduler.groups]
    return wid


def running_step_holds(router, wid: bytes, request_id: str) -> bool:
    sched = router.workers[wid].scheduler
    return bool(sched.in_flight) and any(r.request_id == request_id
                                         for r, _, _ in sched.in_flight[0].entries)


def assert_nothing_held(router):
    for state in router.workers.values():
        sched = state.scheduler
        assert not sched.requests and not sched.groups and not sched.suspects
        assert sched.kv.num_free == sched.kv.num_blocks
    assert not router.pending and not router.seqs


def test_a_sequence_lost_alone_on_two_workers_ends_internal_and_holds_nothing():
    router = make_router(max_plans_in_flight=1)
    with_workers(router, FakeWorker(64), FakeWorker(64), FakeWorker(64))
    add(router, "a", [5, 6, 7, 8, 9], 12)
    out = {}
    for loss in (1, 2):
        assert router.plans()  # its step is running on the worker that holds it
        wid = holder(router, "a#0")
        router.remove(wid, "silent for 1.5 s", step_lost=True)
        check(router)
        collect(router, out)
        if loss == 1:
            assert ("a", 0) not in out  # recomputed on another worker, as before
    assert out[("a", 0)]["finish"] == pb.ERROR and out[("a", 0)]["error"] == "INTERNAL"
    assert "failed on 2 workers in a row" in out[("a", 0)]["message"]
    assert len(router.workers) == 1
    assert_nothing_held(router)


def test_a_sequence_that_got_further_between_losses_counts_from_one_again():
    router = make_router(max_plans_in_flight=1)
    workers = with_workers(router, FakeWorker(64), FakeWorker(64), FakeWorker(64))
    prompt = [5, 6, 7, 8, 9]
    add(router, "a", prompt, 12)
    out = {}
    assert router.plans()
    router.remove(holder(router, "a#0"), "silent", step_lost=True)
    for _ in range(4):  # a few tokens on the next worker
        step(router, workers, out)
    assert len(out[("a", 0)]["tokens"]) >= 2
    router.plans()
    wid = holder(router, "a#0")
    assert running_step_holds(router, wid, "a")
    router.remove(wid, "silent", step_lost=True)
    seq = router.seqs["a"][0]
    assert seq.lost_steps == 1 and not seq.suspect
    run(router, {w: workers[w] for w in router.workers}, out)
    assert out[("a", 0)]["tokens"] == reference_output(prompt, 12)
    assert out[("a", 0)]["finish"] == pb.LENGTH
    assert_nothing_held(router)


def test_only_the_running_step_counts_not_a_plan_queued_behind_it():
    router = make_router(max_plans_in_flight=2)
    workers = with_workers(router, FakeWorker(64))
    add(router, "a", [5, 6, 7, 8, 9], 12)
    router.plans()  # a's prefill runs
    add(router, "b", [1, 2, 3], 12)
    router.plans()  # b joins the plan queued behind it
    sched = router.workers[b"w0"].scheduler
    assert len(sched.in_flight) == 2
    assert {r.request_id for r, _, _ in sched.in_flight[0].entries} == {"a"}
    assert {r.request_id for r, _, _ in sched.in_flight[1].entries} == {"a", "b"}
    a, b = router.seqs["a"][0], router.seqs["b"][0]
    router.register(b"w1", FakeWorker(64).hello())
    workers[b"w1"] = FakeWorker(64)
    router.remove(b"w0", "silent", step_lost=True)
    assert (a.lost_steps, b.lost_steps) == (1, 0)
    out = {}
    run(router, {b"w1": workers[b"w1"]}, out)
    assert out[("a", 0)]["tokens"] == reference_output([5, 6, 7, 8, 9], 12)
    assert out[("b", 0)]["tokens"] == reference_output([1, 2, 3], 12)
    assert_nothing_held(router)


def test_a_killer_ends_internal_and_its_innocent_neighbour_finishes_exact():
    """Whichever worker runs a step with "kill" dies in it; "ok" shares its first two steps.
    At the bound in a shared step both run alone next, so only the killer ends."""
    router = make_router(max_plans_in_flight=1)
    fakes = with_workers(router, FakeWorker(64))
    add(router, "kill", [3, 3, 3, 3], 10)
    add(router, "ok", [4, 4, 4, 4], 10)
    out, losses = {}, []
    for n in range(1, 200):
        while sent := router.plans():
            for wid, plan in sent:
                fakes[wid].inbox.append(plan)
        for wid in list(router.workers):
            if running_step_holds(router, wid, "kill"):
                losses.append({r.request_id for r, _, _ in
                               router.workers[wid].scheduler.in_flight[0].entries})
                router.remove(wid, "silent", step_lost=True)
                fakes[f"n{n}".encode()] = FakeWorker(64)  # its replacement takes the orphans
                router.register(f"n{n}".encode(), fakes[f"n{n}".encode()].hello())
        for wid in list(router.workers):
            if fakes[wid].inbox:
                router.on_result(wid, fakes[wid].execute(fakes[wid].inbox.popleft()))
        check(router)
        collect(router, out)
        if not router.seqs:
            break
    assert losses == [{"kill", "ok"}, {"kill", "ok"}, {"kill"}]
    assert out[("kill", 0)]["error"] == "INTERNAL" and out[("kill", 0)]["tokens"] == []
    assert "failed on 3 workers in a row" in out[("kill", 0)]["message"]
    assert out[("ok", 0)]["tokens"] == reference_output([4, 4, 4, 4], 10)
    assert out[("ok", 0)]["finish"] == pb.LENGTH and out[("ok", 0)]["error"] == ""
    assert_nothing_held(router)


def test_a_beam_search_lost_alone_twice_ends_internal_on_every_index():
    router = make_router(max_plans_in_flight=1)
    with_workers(router, FakeWorker(64), FakeWorker(64), FakeWorker(64))
    router.add(GW, pb.AddRequest(request_id="beam", prompt_token_ids=[5, 6, 7], max_tokens=6,
                                 sampling=pb.SamplingConfig(),
                                 beam_search=pagoda_pb2.BeamSearchParams(beam_width=2)))
    out = {}
    for _ in range(2):
        assert router.plans()
        router.remove(holder(router, "beam#0"), "silent", step_lost=True)
        collect(router, out)
    assert [out[("beam", i)]["error"] for i in range(2)] == ["INTERNAL", "INTERNAL"]
    assert_nothing_held(router)


def test_a_beam_search_at_the_bound_in_a_shared_step_runs_alone_next_and_finishes():
    router = make_router(max_plans_in_flight=1)
    fakes = with_workers(router, FakeWorker(64))
    router.add(GW, pb.AddRequest(request_id="beam", prompt_token_ids=[5, 6, 7], max_tokens=6,
                                 sampling=pb.SamplingConfig(),
                                 beam_search=pagoda_pb2.BeamSearchParams(beam_width=2)))
    add(router, "other", [1, 2, 3], 6)
    for n in (1, 2):  # both lost in a step they share, twice
        assert router.plans()
        (wid,) = router.workers
        assert {r.request_id for r, _, _ in router.workers[wid].scheduler.in_flight[0].entries} \
            == {"beam", "other"}
        router.remove(wid, "silent", step_lost=True)
        fakes[f"n{n}".encode()] = FakeWorker(64)
        router.register(f"n{n}".encode(), fakes[f"n{n}".encode()].hello())
    (wid, plan), = router.plans()
    assert [s.seq_id for s in plan.new_seqs] == ["beam#b0"]  # alone, as a suspect
    fakes[wid].inbox.append(plan)
    out = {}
    run(router, {wid: fakes[wid]}, out)
    assert [out[("beam", i)]["error"] for i in range(2)] == ["", ""]
    assert out[("other", 0)]["tokens"] == reference_output([1, 2, 3], 6)
    assert_nothing_held(router)


@pytest.mark.parametrize("why,step_lost,max_failures", [
    ("silent", True, 0),          # --max-step-failures 0: never ended
    ("said goodbye", False, 2),   # not a lost step: the worker stopped after it
    ("unreachable", False, 2),
])
def test_no_count_or_no_bound_requeues_as_before(why, step_lost, max_failures):
    router = make_router(max_plans_in_flight=1, max_step_failures=max_failures)
    workers = {}
    for i in range(6):
        workers.update({f"w{i}".encode(): FakeWorker(64)})
        router.register(f"w{i}".encode(), workers[f"w{i}".encode()].hello())
    add(router, "a", [5, 6, 7, 8, 9], 12)
    for _ in range(5):
        assert router.plans()
        router.remove(holder(router, "a#0"), why, step_lost=step_lost)
    out = {}
    run(router, {w: workers[w] for w in router.workers}, out)
    assert out[("a", 0)]["tokens"] == reference_output([5, 6, 7, 8, 9], 12)
    assert_nothing_held(router)
