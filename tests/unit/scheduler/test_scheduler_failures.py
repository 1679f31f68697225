"""Failure isolation in the scheduler, against the in-process fake worker: a step the worker fails
ends only the sequence that breaks it (INTERNAL, a short message), the others finish token-exact,
and a late or repeated result never lands on the wrong plan. The block invariant is checked after
every result (tests/unit/scheduler/test_scheduler.py's step())."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from proto import internal_pb2 as pb
from scheduler.router import FAILED_ALONE
from tests.fake_worker import EOS_MARK, POISON_MARK, FakeWorker, reference_output
from tests.unit.scheduler.test_scheduler import STOPS, add, check, collect, make_router, run, step, with_workers


def prompts(n: int) -> dict[str, list[int]]:
    # A shared head, so that recomputes and newcomers hit the prefix cache.
    return {f"r{i}": [7, 7, 7, 7, 8, 8, 8, 8] + [i + 1] * (3 + i) for i in range(n)}


def one_worker_with(n: int, max_tokens: int, plans_in_flight: int):
    """A router with plans_in_flight plans in flight, one FakeWorker(64) and prompts(n) added,
    each for max_tokens: (router, the fake worker, the workers table, the prompts)."""
    router = make_router(max_plans_in_flight=plans_in_flight)
    fake = FakeWorker(64)
    workers = with_workers(router, fake)
    ps = prompts(n)
    for rid, prompt in ps.items():
        add(router, rid, prompt, max_tokens)
    return router, fake, workers, ps


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
    assert not sched.requests and not sched.suspects and sched.kv.num_free == num_blocks
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
    assert out[("bad", 0)]["error"] == "INTERNAL"
    assert out[("bad", 0)]["message"] == FAILED_ALONE  # not the worker's "Poisoned: slot 0 ..."
    assert len(FAILED_ALONE) < 80


def test_a_sequence_that_fails_once_and_then_succeeds_alone_is_cleared():
    router, _, workers, ps = one_worker_with(3, 12, plans_in_flight=2)
    out = {}
    (wid, plan), = router.plans()
    router.on_result(wid, pb.StepResult(step_id=plan.step_id, error="RuntimeError: a passing fault"))
    check(router)
    sched = router.workers[b"w0"].scheduler
    assert sorted(r.seq_id for r in sched.suspects) == ["r0#0", "r1#0", "r2#0"]
    assert sched.kv.num_free == 64  # their blocks went back while they wait
    run(router, workers, out)
    for rid, prompt in ps.items():
        assert out[(rid, 0)]["tokens"] == reference_output(prompt, 12)
        assert out[(rid, 0)]["finish"] == pb.LENGTH
    assert not sched.suspects


def test_the_plan_in_flight_after_a_failed_one_is_void_and_its_result_dropped():
    router, fake, workers, ps = one_worker_with(2, 10, plans_in_flight=2)
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
    router, fake, workers, ps = one_worker_with(2, 10, plans_in_flight=1)
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
    assert sched.kv.num_free == 64


def test_a_result_ahead_of_the_oldest_plan_drops_the_worker_and_requeues():
    router = make_router(max_plans_in_flight=1)
    fake = FakeWorker(64)
    with_workers(router, fake)
    add(router, "a", [1, 2, 3, 4, 5], 6)
    (wid, plan), = router.plans()
    router.on_result(wid, pb.StepResult(step_id=plan.step_id + 1))
    assert wid not in router.workers and [r.seq_id for r in router.pending] == ["a#0"]
    assert router.pending[0].num_computed_tokens == 0


ops = st.lists(st.tuples(st.sampled_from(["add", "add_n", "poison", "step", "steps", "fault", "abort"]),
                         st.integers(0, 10 ** 6)), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
# Found by this test: n = 3 swapped out before its fork, then swapped in by a step that had no
# room to fork it; that step planned nothing else, was dropped as empty, and its swap-in with it.
@example(operations=[("add", 187), ("step", 0), ("add", 187), ("steps", 5), ("add_n", 1)])
def test_failures_end_only_the_poisoned_under_random_operations(operations):
    """Random requests (n > 1, stops, EOS, shared prefixes), poisoned ones, transient faults (a
    step the worker computed but reports failed) and aborts, on two workers with preemption and
    swap: only poisoned sequences end INTERNAL, every other is token-exact, blocks balance."""
    router = make_router(max_num_batched_tokens=24, max_num_seqs=6)
    workers = with_workers(router, FakeWorker(12, block_size=4, num_cpu_blocks=8),
                           FakeWorker(16, block_size=4))
    out, ids, prompts, aborted = {}, [], {}, set()
    for op, x in operations:
        rng = random.Random(x)
        if op in ("add", "add_n", "poison"):
            rid = f"r{len(ids)}"
            shared = [1, 2, 3, 4, 5, 6, 7, 8] if rng.random() < 0.5 else []
            prompt = shared + [rng.randrange(1, 990) for _ in range(rng.randrange(1, 10))]
            if op == "poison":
                prompt = [POISON_MARK, rng.randrange(0, 6)] + prompt
            elif rng.random() < 0.3:
                prompt = [EOS_MARK, rng.randrange(1, 12)] + prompt
            n = rng.randrange(2, 4) if op == "add_n" else 1
            stops = STOPS if rng.random() < 0.3 else []
            max_tokens = rng.randrange(1, 12 if rng.random() < 0.7 else 30)
            try:
                router.add(b"gw", pb.AddRequest(
                    request_id=rid, prompt_token_ids=prompt, n=n, stop_token_ids=stops,
                    max_tokens=max_tokens, sampling=pb.SamplingConfig(has_seed=True, seed=x)))
            except Exception:  # noqa: BLE001 - Rejected: too long for a worker
                continue
            ids.append(rid)
            prompts[rid] = (prompt, x, set(stops), max_tokens)
        elif op == "step":
            step(router, workers, out)
        elif op == "steps":
            for _ in range(rng.randrange(2, 15)):
                step(router, workers, out)
        elif op == "fault":  # the oldest plan of a busy worker runs, but is reported failed
            busy = [w for w in workers if workers[w].inbox]
            if busy:
                wid = rng.choice(busy)
                plan = workers[wid].inbox.popleft()
                workers[wid].execute(plan)
                router.on_result(wid, pb.StepResult(step_id=plan.step_id, error="OSError: a passing fault"))
                collect(router, out)
        elif op == "abort" and ids:
            victim = rng.choice(ids)
            aborted.add(victim)
            router.abort(victim)
        check(router)
    run(router, workers, out)
    check(router)
    for state in router.workers.values():
        assert not state.scheduler.requests and not state.scheduler.suspects
        assert state.scheduler.kv.num_free == state.scheduler.kv.num_blocks
    for (rid, index), entry in out.items():
        prompt, seed, stops, max_tokens = prompts[rid]
        want = reference_output(prompt, max_tokens, seed + index, stop_token_ids=stops)
        tokens = entry["tokens"]
        assert tokens == want[:len(tokens)], (rid, index)
        if rid in aborted:
            continue
        if prompt[0] == POISON_MARK and len(want) > prompt[1]:  # else it ends before it breaks
            assert entry["error"] == "INTERNAL" and len(tokens) <= prompt[1], (rid, entry)
        else:
            assert entry["error"] == "" and tokens == want, (rid, index, entry)
