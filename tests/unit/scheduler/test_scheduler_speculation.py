"""Speculative decoding as the scheduler sees it, against the in-process fake worker, whose
proposer is right for a few tokens and then wrong (tests/fake_worker.py): every output equals
the reference of one token a step, wherever a stop id, EOS or the length limit falls inside an
accepted run; rows that may not speculate never do; preemption and the prefix cache stay exact
(a prefix hit over blocks whose rejected slots held proposals reads only accepted tokens); the
block invariant holds after every step (tests/unit/scheduler/test_scheduler.py's check)."""
from __future__ import annotations

import random

import pytest

from proto import internal_pb2 as pb
from proto.columns import pack, unpack_list
from tests.fake_worker import EOS, EOS_MARK, FakeWorker, reference_output
from tests.unit.scheduler.test_scheduler import GW, collect, make_router, run, step, with_workers


def add(router, rid, prompt, max_tokens, seed=0, **kw):
    router.add(GW, pb.AddRequest(request_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens,
                                 sampling=pb.SamplingConfig(has_seed=True, seed=seed,
                                                            **kw.pop("sampling", {})), **kw))


def test_runs_of_accepted_tokens_give_the_reference_output():
    router = make_router()
    worker = FakeWorker(256, block_size=4, num_speculative_tokens=4)
    workers = with_workers(router, worker)
    rng = random.Random(1)
    stops = rng.sample(range(1, 999), 40)  # some runs hold a stop id
    cases = {}
    for i in range(24):
        prompt = [rng.randrange(1, 990) for _ in range(rng.randrange(2, 12))]
        if i % 4 == 0:  # EOS at a chosen output index, often inside a run
            prompt = [EOS_MARK, rng.randrange(1, 30)] + prompt
        max_tokens = rng.randrange(1, 60)
        kw = {"stop_token_ids": stops} if i % 3 == 0 else {}
        add(router, f"r{i}", prompt, max_tokens, seed=i, **kw)
        cases[f"r{i}"] = (prompt, max_tokens, i, kw.get("stop_token_ids", ()))
    out, plans = {}, []
    run(router, workers, out, plans_seen=plans)
    for rid, (prompt, max_tokens, seed, stop_ids) in cases.items():
        expected = reference_output(prompt, max_tokens, seed, stop_token_ids=stop_ids)
        assert out[(rid, 0)]["tokens"] == expected, rid
        ended = expected[-1] in set(stop_ids) | {EOS}
        assert out[(rid, 0)]["finish"] == (pb.STOP if ended else pb.LENGTH), rid
    assert worker.accepted > 100 and worker.drafts > worker.accepted  # it accepted, and rejected
    assert any(len(unpack_list(p.spec_slots)) for p in plans)
    # Fewer steps than tokens: accepted runs are what speculation is for.
    assert len(plans) < sum(len(e["tokens"]) for e in out.values()) / 2
    kv = router.workers[b"w0"].scheduler.kv
    assert kv.num_free == kv.num_blocks


def test_a_run_streams_as_one_update_of_several_tokens():
    router = make_router()
    workers = with_workers(router, FakeWorker(64, block_size=4, num_speculative_tokens=4))
    add(router, "a", [5, 6, 7], 40, seed=2)
    sizes, out = [], {}
    while step(router, workers, out):  # each step's result, collected as it comes
        sizes.append(len(out.get(("a", 0), {"tokens": []})["tokens"]))
    growth = [b - a for a, b in zip([0] + sizes, sizes)]
    assert max(growth) > 1 and sum(growth) == 40
    assert out[("a", 0)]["tokens"] == reference_output([5, 6, 7], 40, 2)


def test_every_row_speculates_but_a_beam_search():
    """Penalties, logit_bias and min_tokens are applied per verified position and logprobs come
    for each token of a run (the worker's business), so those rows speculate; a beam search's
    group picks its tokens from candidates, one step at a time, and does not."""
    from tests.unit.scheduler.test_scheduler_beam import add_beam
    router = make_router()
    workers = with_workers(router, FakeWorker(128, block_size=4, num_speculative_tokens=3))
    cases = {"plain": ([1, 2, 3], {}), "penalty": ([4, 5, 6], {"presence_penalty": 0.5}),
             "bias": ([7, 8, 9], {"logit_bias": {5: 1.0}}), "min": ([10, 11, 12], {"min_tokens": 8}),
             "logprobs": ([13, 14, 15], {"logprobs": 0})}
    for rid, (prompt, sampling) in cases.items():
        add(router, rid, prompt, 20, sampling=sampling)
    add_beam(router, "beam", [16, 17, 18], 8, width=2)
    out, plans = {}, []
    run(router, workers, out, plans_seen=plans)
    speculated = {s for p in plans for s in unpack_list(p.spec_slots)}
    slots_of: dict[str, set[int]] = {}
    for p in plans:
        for s in p.new_seqs:
            slots_of.setdefault(s.seq_id.split("#")[0], set()).add(s.slot)
    for rid in cases:
        assert slots_of[rid] & speculated, rid
    assert not slots_of["beam"] & speculated
    for rid, (prompt, sampling) in cases.items():
        expected = reference_output(prompt, 20, 0, min_tokens=sampling.get("min_tokens", 0))
        assert out[(rid, 0)]["tokens"] == expected, rid
    assert not router.workers[b"w0"].scheduler.requests


@pytest.mark.parametrize("mode,cpu_blocks", [("recompute", 0), ("swap", 40)])
def test_preemption_with_speculation_gives_the_undisturbed_output(mode, cpu_blocks):
    router = make_router()
    worker = FakeWorker(14, block_size=4, num_cpu_blocks=cpu_blocks, num_speculative_tokens=4)
    workers = with_workers(router, worker)
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(1, 990) for _ in range(rng.randrange(3, 9))] for i in range(6)}
    for i, (rid, p) in enumerate(prompts.items()):
        add(router, rid, p, 14, seed=i)
    out = {}
    run(router, workers, out)
    sched = router.workers[b"w0"].scheduler
    assert sched.stats.num_preemptions[mode] > 0 and worker.accepted > 0
    for i, (rid, p) in enumerate(prompts.items()):
        assert out[(rid, 0)]["tokens"] == reference_output(p, 14, i), rid
    assert sched.kv.num_free == sched.kv.num_blocks
    assert sched.kv.num_cpu_free == cpu_blocks


def test_a_prefix_hit_over_generated_blocks_reads_only_accepted_tokens():
    """The second prompt is the first's prompt and output: its prefix hit covers blocks that
    were written by verification forwards, whose rejected proposals the cache held for a while."""
    router = make_router()
    worker = FakeWorker(256, block_size=4, num_speculative_tokens=4)
    workers = with_workers(router, worker)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    add(router, "first", prompt, 41, seed=5)
    out = {}
    run(router, workers, out)
    first = out[("first", 0)]["tokens"]
    assert first == reference_output(prompt, 41, 5) and worker.drafts > worker.accepted > 0
    second = prompt + first + [7]
    add(router, "second", second, 12, seed=6)
    run(router, workers, out)
    assert out[("second", 0)]["cached"] >= 40  # ten full blocks hashed from accepted tokens
    assert out[("second", 0)]["tokens"] == reference_output(second, 12, 6)


def test_a_result_that_accepts_more_than_the_plan_allowed_drops_the_worker():
    router = make_router()
    worker = FakeWorker(64, block_size=4, num_speculative_tokens=2)
    workers = with_workers(router, worker)
    add(router, "a", [5, 6, 7], 30)
    out = {}
    for _ in range(3):
        step(router, workers, out)
    (wid, plan), = router.plans()
    result = worker.execute(plan)
    counts = unpack_list(result.num_tokens) if result.num_tokens else [1]
    tokens = unpack_list(result.token_ids) + [9] * (4 - counts[0] + 1)
    result.token_ids, result.num_tokens = pack(tokens), pack([5])
    result.num_drafts = pack([4])
    router.on_result(wid, result)
    assert wid not in router.workers  # dropped: the blocks hold no fifth token


def test_draft_lengths_follow_what_each_sequence_accepted():
    from scheduler.draft_length import DraftLength
    d = DraftLength(1)                   # as after a pause: one token
    d.update(1, 1, most=4)
    assert d.next() == 2                 # accepted in full: one more, up to the worker's k
    d.update(2, 2, most=4)
    assert d.next() == 3
    d.update(3, 1, most=4)
    assert d.next() == 4                 # cut short: the worker's k again
    d.update(0, 0, most=4)
    assert d.next() == 4                 # no n-gram matched: nothing learned
    d.update(4, 0, most=4)
    assert d.next() == 4                 # one draft that failed outright
    d.update(4, 0, most=4)               # the second in a row
    assert [d.next() for _ in range(5)] == [0, 0, 0, 0, 1]  # paused 4 steps, then one token
    d.update(1, 0, most=4)
    d.update(1, 0, most=4)
    assert [d.next() for _ in range(9)] == [0] * 8 + [1]    # each pause twice the last


def test_a_sequence_whose_proposals_always_fail_mostly_stops_proposing():
    router = make_router()
    worker = FakeWorker(64, block_size=4, num_speculative_tokens=4, always_wrong=True)
    workers = with_workers(router, worker)
    add(router, "a", [5, 6, 7], 120, seed=4)
    out, plans = {}, []
    run(router, workers, out, plans_seen=plans)
    assert out[("a", 0)]["tokens"] == reference_output([5, 6, 7], 120, 4)
    speculating = sum(bool(len(unpack_list(p.spec_slots))) for p in plans)
    assert worker.accepted == 0 and 0 < speculating < len(plans) / 5


def test_a_worker_that_paces_its_drafts_is_offered_k_at_every_decode():
    """Method suffix sizes each draft itself: the scheduler never pauses its sequences, however
    their proposals fare, and plans one step at a time while they may propose."""
    router = make_router()
    worker = FakeWorker(64, block_size=4, num_speculative_tokens=4, always_wrong=True,
                        paced_by_worker=True)
    workers = with_workers(router, worker)
    add(router, "a", [5, 6, 7], 60, seed=4)
    out, plans = {}, []
    run(router, workers, out, plans_seen=plans)
    assert out[("a", 0)]["tokens"] == reference_output([5, 6, 7], 60, 4)
    offered = [unpack_list(p.spec_num_tokens) for p in plans if len(unpack_list(p.spec_slots))]
    decodes = [p for p in plans if len(unpack_list(p.running_slots))]
    # Every decode but those whose length limit leaves no room offers the full k.
    assert worker.accepted == 0 and len(offered) >= len(decodes) - 4
    assert all(k == [4] for k in offered[:-4])


def test_while_every_sequence_has_paused_its_drafts_the_scheduler_plans_ahead():
    """Speculation and the plan ahead: one plan at a time while any sequence would propose,
    two in flight while all have paused, never a plan behind one that speculates."""
    router = make_router()
    worker = FakeWorker(64, block_size=4, num_speculative_tokens=4, always_wrong=True)
    workers = with_workers(router, worker)
    add(router, "a", [5, 6, 7], 150, seed=4)
    add(router, "b", [8, 9], 150, seed=5)
    sched = router.workers[b"w0"].scheduler
    out, depth, behind_spec = {}, [], 0
    while True:
        while sent := router.plans():  # as many as the scheduler will have in flight
            for wid, plan in sent:
                if worker.inbox and len(unpack_list(worker.inbox[-1].spec_slots)):
                    behind_spec += 1
                worker.inbox.append(plan)
        depth.append(len(sched.in_flight))
        if not worker.inbox:
            break
        router.on_result(b"w0", worker.execute(worker.inbox.popleft()))
        collect(router, out)
    assert behind_spec == 0 and 2 in depth and 1 in depth
    assert depth.count(2) > len(depth) / 2  # paused most of the time: mostly planned ahead
    assert out[("a", 0)]["tokens"] == reference_output([5, 6, 7], 150, 4)
    assert out[("b", 0)]["tokens"] == reference_output([8, 9], 150, 5)


def test_no_proposals_while_more_sequences_run_than_disable_by_batch_size():
    router = make_router()
    workers = with_workers(router, FakeWorker(128, block_size=4, num_speculative_tokens=3,
                                              disable_by_batch_size=2))
    lengths = {"a": 10, "b": 20, "c": 60}
    for i, (rid, n) in enumerate(lengths.items()):
        add(router, rid, [i + 1, i + 2, i + 3], n, seed=i)
    out, plans = {}, []
    run(router, workers, out, plans_seen=plans)
    for plan in plans:
        running = len(unpack_list(plan.running_slots)) + len(plan.new_seqs)
        if running > 2:
            assert not len(unpack_list(plan.spec_slots)), plan.step_id
    assert any(len(unpack_list(p.spec_slots)) for p in plans)  # once "a" finished
    for i, (rid, n) in enumerate(lengths.items()):
        assert out[(rid, 0)]["tokens"] == reference_output([i + 1, i + 2, i + 3], n, i)
