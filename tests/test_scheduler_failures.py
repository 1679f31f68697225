"""Failure isolation in the scheduler, against the in-process fake worker: a step the worker fails
ends only the sequence that breaks it (INTERNAL, a short message), the others finish token-exact,
and a late or repeated result never lands on the wrong plan. The block invariant is checked after
every result (tests/test_scheduler.py's step())."""
from __future__ import annotations

import pytest

from proto import internal_pb2 as pb
from scheduler.router import FAILED_ALONE
from tests.fake_worker import POISON_MARK, FakeWorker, reference_output
from tests.test_scheduler import add, check, collect, make_router, run, step, with_workers


def prompts(n: int) -> dict[str, list[int]]:
    # A shared head, so that recomputes and newcomers hit the prefix cache.
    return {f"r{i}": [7, 7, 7, 7, 8, 8, 8, 8] + [i + 1] * (3 + i) for i in range(n)}


@pytest.mark.parametrize("plans_in_flight", [1, 2])
@pytest.mark.parametrize("poison_after", [0, 1, 9])  # its prefill, its first decode, mid-stream
@pytest.mark.parametrize("num_blocks,cpu_blocks", [(256, 0), (24, 0), (24, 16)])
def test_a_poisoned_sequence_ends_internal_and_the_others_finish_exact(
        plans_in_flight, poison_after, num_blocks, cpu_blocks):
    router = make_router(max_plans_in_flight=plans_in_flight, max_num_batched_tokens=32)
    fake = FakeWorker(num_blocks, num_cpu_blocks=cpu_blocks)
    workers = with_workers(router, fake)
    good = prompts(7)
    poison = [POISON_MARK, poison_after, 5, 5, 5]
    for i, (rid, prompt) in enumerate(good.items()):
        add(router, rid, prompt, 20)
        if i == 3:
            add(router, "bad", poison, 20)
    out, plans, failed = {}, [], []
    execute = fake.execute

    def execute_and_note_failures(plan):
        result = execute(plan)
        if result.error:
            failed.append(plan.step_id)
        return result
    fake.execute = execute_and_note_failures
    run(router, workers, out, plans_seen=plans)
    assert out[("bad", 0)]["finish"] == pb.ERROR and out[("bad", 0)]["error"] == "INTERNAL"
    assert out[("bad", 0)]["tokens"] == reference_output(poison, 20)[:len(out[("bad", 0)]["tokens"])]
    assert len(out[("bad", 0)]["tokens"]) <= poison_after
    for rid, prompt in good.items():
        assert out[(rid, 0)]["tokens"] == reference_output(prompt, 20), rid
        assert out[(rid, 0)]["finish"] == pb.LENGTH
    sched = router.workers[b"w0"].scheduler
    assert not sched.requests and not sched.suspects and sched.kv.pool.num_free == num_blocks
    # Once it failed, the poisoned sequence only ever ran alone.
    failed_at = next(i for i, p in enumerate(plans) if p.step_id == failed[0])
    later = [p for p in plans[failed_at + 1:] if any(s.seq_id == "bad#0" for s in p.new_seqs)]
    assert later and all(len(p.new_seqs) == 1 and not p.running_slots for p in later)


def test_the_message_of_a_failed_sequence_is_short_and_names_no_exception():
    router = make_router()
    workers = with_workers(router, FakeWorker(64))
    add(router, "bad", [POISON_MARK, 0, 3], 5)
    out = {}
    run(router, workers, out)
    msgs = [d for m in router.take_outbox().values() for d in m.deltas]
    assert out[("bad", 0)]["error"] == "INTERNAL" and not msgs  # already collected by run()
    # collect() keeps the code; the message is the router's constant, not the worker's text.
    assert "Error" not in FAILED_ALONE and "Traceback" not in FAILED_ALONE and len(FAILED_ALONE) < 80


def test_a_sequence_that_fails_once_and_then_succeeds_alone_is_cleared():
    router = make_router(max_plans_in_flight=2)
    fake = FakeWorker(64)
    workers = with_workers(router, fake)
    ps = prompts(3)
    for rid, prompt in ps.items():
        add(router, rid, prompt, 12)
    out = {}
    (wid, plan), = router.plans()
    router.on_result(wid, pb.StepResult(step_id=plan.step_id, error="RuntimeError: a passing fault"))
    check(router)
    sched = router.workers[b"w0"].scheduler
    assert sorted(r.seq_id for r in sched.suspects) == ["r0#0", "r1#0", "r2#0"]
    assert sched.kv.pool.num_free == 64  # their blocks went back while they wait
    run(router, workers, out)
    for rid, prompt in ps.items():
        assert out[(rid, 0)]["tokens"] == reference_output(prompt, 12)
        assert out[(rid, 0)]["finish"] == pb.LENGTH
    assert not sched.suspects


def test_the_plan_in_flight_after_a_failed_one_is_void_and_its_result_dropped():
    router = make_router(max_plans_in_flight=2)
    fake = FakeWorker(64)
    workers = with_workers(router, fake)
    ps = prompts(2)
    for rid, prompt in ps.items():
        add(router, rid, prompt, 10)
    out = {}
    for _ in range(3):
        step(router, workers, out)
    sched = router.workers[b"w0"].scheduler
    assert len(fake.inbox) == 1 and len(sched.in_flight) == 1
    router.plans()  # fills the pipeline: two plans on the worker now
    first, second = sched.in_flight
    fake.inbox.clear()
    router.on_result(b"w0", pb.StepResult(step_id=first.step_id, error="RuntimeError: boom"))
    check(router)
    assert second.void and not sched.waiting and len(sched.suspects) == sched.num_waiting == 2
    assert all(r.num_pending == 0 and r.num_computed_tokens == 0 for r in sched.suspects)
    # The void plan's result carries tokens for a state that no longer exists: dropped.
    router.on_result(b"w0", pb.StepResult(step_id=second.step_id, slots=b"\x00\x00\x00\x00",
                                          token_ids=b"\x05\x00\x00\x00"))
    check(router)
    assert not sched.in_flight
    fake.seqs.clear()  # the real worker forgets them through the next plan's dropped_slots
    run(router, workers, out)
    for rid, prompt in ps.items():
        assert out[(rid, 0)]["tokens"] == reference_output(prompt, 10)


def test_stale_repeated_and_unasked_results_are_dropped():
    router = make_router(max_plans_in_flight=1)
    fake = FakeWorker(64)
    workers = with_workers(router, fake)
    ps = prompts(2)
    for rid, prompt in ps.items():
        add(router, rid, prompt, 10)
    out = {}
    (wid, old_plan), = router.plans()
    old_result = fake.execute(old_plan)
    # The worker registers again (a restart): the same routing id, a new epoch of step ids.
    router.register(wid, fake.hello())
    fake.seqs.clear()
    check(router)
    sched = router.workers[wid].scheduler
    (_, new_plan), = router.plans()
    assert new_plan.step_id > old_plan.step_id  # ids never repeat across registrations
    router.on_result(wid, old_result)  # late, from the first registration: dropped
    check(router)
    assert len(sched.in_flight) == 1 and wid in router.workers
    new_result = fake.execute(new_plan)
    router.on_result(wid, new_result)
    router.on_result(wid, new_result)  # a repeat: dropped, the worker is not busy
    check(router)
    assert wid in router.workers and not sched.in_flight
    collect(router, out)
    run(router, workers, out)
    for rid, prompt in ps.items():
        assert out[(rid, 0)]["tokens"] == reference_output(prompt, 10)
    assert sched.kv.pool.num_free == 64


def test_a_result_ahead_of_the_oldest_plan_drops_the_worker_and_requeues():
    router = make_router(max_plans_in_flight=1)
    fake = FakeWorker(64)
    with_workers(router, fake)
    add(router, "a", [1, 2, 3, 4, 5], 6)
    (wid, plan), = router.plans()
    router.on_result(wid, pb.StepResult(step_id=plan.step_id + 1))
    assert wid not in router.workers and [r.seq_id for r in router.pending] == ["a#0"]
    assert router.pending[0].num_computed_tokens == 0
