"""Beam search in the scheduler against the in-process fake worker, whose "model" gives top-K
candidates (EOS among them) read back through the block table: the answers must equal
transformers' algorithm run on full contexts (tests/beam_reference.py), whatever forks, drops,
copies, preemptions, aborts and worker losses happen on the way, and the block invariant must
hold after every operation."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from proto import internal_pb2 as pb, pagoda_pb2
from proto.columns import unpack_list
from proto.token_stream import updates
from scheduler.router import Rejected, Router, RouterConfig
from tests.beam_reference import reference_beam_search
from tests.fake_worker import EOS, POISON_MARK, FakeWorker, beam_distribution
from tests.unit.scheduler.test_scheduler import abort_or_lose, check, with_workers
from tests.unit.scheduler.test_scheduler import run as scheduler_run, step as scheduler_step

GW = b"gw"


def add_beam(router, rid, prompt, max_tokens, width, length_penalty=1.0, early_stopping="false",
             gateway=GW, **kw):
    router.add(gateway, pb.AddRequest(
        request_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens,
        sampling=pb.SamplingConfig(), beam_search=pagoda_pb2.BeamSearchParams(
            beam_width=width, length_penalty=length_penalty, early_stopping=early_stopping), **kw))


def collect(router, outputs):
    for msg in router.take_outbox().values():
        for u in updates(msg):
            entry = outputs.setdefault((u.request_id, u.index), {"tokens": [], "finish": 0,
                                                                 "deltas": 0})
            entry["tokens"] += u.token_ids
            entry["deltas"] += 1
            d = u.news if u.news is not None else pb.TokenDelta()
            if d.finish:
                entry["finish"], entry["error"] = d.finish, d.error.code
                entry["preemptions"] = d.num_preemptions
                entry["logprob"] = d.cumulative_logprob if d.HasField("cumulative_logprob") else None


def step(router, workers, outputs, plans=None):
    return scheduler_step(router, workers, outputs, plans, collect_fn=collect)


def run(router, workers, outputs, plans=None):
    scheduler_run(router, workers, outputs, 20000, plans, collect_fn=collect)


def path_logprob(prompt, tokens):
    return sum(dict(beam_distribution(prompt + tokens[:i]))[t] for i, t in enumerate(tokens))


def assert_matches(out, rid, prompt, max_tokens, width, lp=1.0, early="false"):
    expected = reference_beam_search(prompt, width, max_tokens, lp, early)
    for i, (tokens, _) in enumerate(expected):
        got = out[(rid, i)]
        assert got["tokens"] == tokens, (rid, i)
        assert got["deltas"] == 1  # one final message per beam, nothing streamed before
        assert got["finish"] == (pb.STOP if tokens[-1] == EOS else pb.LENGTH)
        assert got["logprob"] == pytest.approx(path_logprob(prompt, tokens), abs=1e-4)
    assert (rid, width) not in out


@pytest.mark.parametrize("width,lp,early", [(1, 1.0, "false"), (2, 1.0, "false"), (4, 1.0, "false"),
                                            (4, 0.0, "never"), (3, 2.0, "never"), (4, -0.5, "true"),
                                            (5, 1.0, "true")])
def test_beam_search_matches_transformers_algorithm(width, lp, early):
    router = Router(RouterConfig())
    workers = with_workers(router, FakeWorker(256, block_size=4))
    rng = random.Random(width)
    prompts = {f"b{i}": [rng.randrange(1, 990) for _ in range(rng.randrange(2, 11))] for i in range(4)}
    for rid, prompt in prompts.items():
        add_beam(router, rid, prompt, 12, width, lp, early)
    add_beam(router, "plain", [5, 6, 7], 3, width)  # alongside ordinary requests
    router.add(GW, pb.AddRequest(request_id="s", prompt_token_ids=[1, 2, 3], max_tokens=9,
                                 sampling=pb.SamplingConfig()))
    out = {}
    run(router, workers, out)
    for rid, prompt in prompts.items():
        assert_matches(out, rid, prompt, 12, width, lp, early)
    sched = router.workers[b"w0"].scheduler
    assert not sched.requests and not sched.groups and not router.seqs
    assert sched.kv.num_free == sched.kv.num_blocks


def test_forks_share_every_block_and_copy_a_partial_one_only_when_written():
    router = Router(RouterConfig())
    worker = FakeWorker(64, block_size=4)
    workers = with_workers(router, worker)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks and a partial one
    add_beam(router, "p", prompt, 6, 3)
    out, plans = {}, []
    step(router, workers, out, plans)  # the prompt, and its candidates
    sched = router.workers[b"w0"].scheduler
    beams = sched.groups["p#0"].beams
    assert len(beams) == 3 and worker.copies == 0
    # Forked, not copied: all three hold the same three blocks until one writes.
    assert beams[0].block_ids == beams[1].block_ids == beams[2].block_ids
    assert [sched.kv.ref_count(b) for b in beams[0].block_ids] == [3, 3, 3]
    prefix, shared = beams[0].block_ids[:2], beams[0].block_ids[2]
    step(router, workers, out, plans)
    plan = plans[-1]
    # The two forks are new to the worker and copy the partial block as they write into it;
    # the beam that stays in its slot keeps it, and its next token comes in the plan.
    assert [c.src for c in plan.copy] == [shared, shared] and len(plan.new_seqs) == 2
    assert [s.block_ids[2] for s in plan.new_seqs] == [c.dst for c in plan.copy]
    assert [s.block_ids[:2] for s in plan.new_seqs] == [prefix] * 2
    assert len(unpack_list(plan.next_token_slots)) == 1 and worker.copies == 2
    run(router, workers, out, plans)
    assert_matches(out, "p", prompt, 6, 3)
    # Every other write went into a block of its own: copies happen only after a fork.
    assert all(len(p.copy) <= 2 for p in plans)


def test_beam_search_uses_fewer_blocks_than_independent_sequences():
    peaks = {}
    for width, beam in ((4, True), (4, False)):
        router = Router(RouterConfig())
        workers = with_workers(router, FakeWorker(400, block_size=4))
        prompt = [random.Random(1).randrange(1, 990) for _ in range(64)]
        if beam:
            add_beam(router, "x", prompt, 16, width, early_stopping="never", ignore_eos=True)
        else:
            for i in range(width):
                router.add(GW, pb.AddRequest(request_id=f"x{i}", prompt_token_ids=prompt,
                                             max_tokens=16, ignore_eos=True, sampling=pb.SamplingConfig()))
        out, peak = {}, 0
        kv = router.workers[b"w0"].scheduler.kv
        while step(router, workers, out):
            peak = max(peak, kv.num_used)
        peaks[beam] = peak
    assert peaks[True] <= 0.65 * peaks[False], peaks


def test_preempted_group_recomputes_as_a_whole():
    router = Router(RouterConfig(max_num_batched_tokens=16))
    # 20 blocks of 4 for two groups of width 3 and three ordinary requests: preemption is certain.
    workers = with_workers(router, FakeWorker(20, block_size=4))
    rng = random.Random(5)
    prompts = {f"g{i}": [rng.randrange(1, 990) for _ in range(9)] for i in range(2)}
    for rid, prompt in prompts.items():
        add_beam(router, rid, prompt, 14, 3, early_stopping="never", ignore_eos=True)
    for i in range(3):
        router.add(GW, pb.AddRequest(request_id=f"o{i}", prompt_token_ids=[i + 1] * 10,
                                     max_tokens=20, sampling=pb.SamplingConfig()))
    out = {}
    run(router, workers, out)
    sched = router.workers[b"w0"].scheduler
    assert sched.stats.num_preemptions["recompute"] > 0
    for rid, prompt in prompts.items():
        expected = reference_beam_search(prompt, 3, 14, 1.0, "never", eos=())
        assert [out[(rid, i)]["tokens"] for i in range(3)] == [t for t, _ in expected]


def test_abort_frees_every_beam_and_ends_every_index():
    router = Router(RouterConfig())
    workers = with_workers(router, FakeWorker(64, block_size=4))
    add_beam(router, "a", list(range(1, 8)), 20, 4, public_id="pub", early_stopping="never")
    out = {}
    for _ in range(4):
        step(router, workers, out)
    sched = router.workers[b"w0"].scheduler
    assert len(sched.groups["a#0"].beams) == 4
    assert router.abort_public(["pub"]) == ["pub"]
    check(router)
    assert not sched.requests and sched.kv.num_free == 64 and not router.seqs
    run(router, workers, out)
    assert [out[("a", i)]["finish"] for i in range(4)] == [pb.ABORT] * 4


def test_a_failed_step_requeues_the_group_whole():
    router = Router(RouterConfig())
    workers = with_workers(router, FakeWorker(64, block_size=4))
    prompt = [11, 12, 13, 14, 15]
    add_beam(router, "g", prompt, 10, 3)
    # Breaks every step that computes it from its third output token on.
    router.add(GW, pb.AddRequest(request_id="bad", prompt_token_ids=[POISON_MARK, 2, 5, 6],
                                 max_tokens=8, sampling=pb.SamplingConfig()))
    out = {}
    run(router, workers, out)
    assert out[("bad", 0)]["error"] == "INTERNAL"
    assert router.workers[b"w0"].scheduler.stats.num_preemptions["recompute"] == 0
    assert out[("g", 0)]["preemptions"] > 0  # it shared a failed step, and went back whole
    assert_matches(out, "g", prompt, 10, 3)


def test_a_group_that_breaks_the_worker_ends_with_internal_and_the_others_go_on():
    router = Router(RouterConfig())
    workers = with_workers(router, FakeWorker(64, block_size=4))
    add_beam(router, "bad", [POISON_MARK, 2, 7, 8], 10, 3)  # breaks every step from 2 outputs on
    add_beam(router, "good", [21, 22, 23], 8, 2)
    router.add(GW, pb.AddRequest(request_id="plain", prompt_token_ids=[5, 6], max_tokens=12,
                                 sampling=pb.SamplingConfig()))
    out = {}
    run(router, workers, out)
    assert [out[("bad", i)]["error"] for i in range(3)] == ["INTERNAL"] * 3
    assert_matches(out, "good", [21, 22, 23], 8, 2)
    assert out[("plain", 0)]["finish"] == pb.LENGTH and not out[("plain", 0)]["error"]
    sched = router.workers[b"w0"].scheduler
    assert not sched.requests and sched.kv.num_free == 64


def test_rejections():
    router = Router(RouterConfig(max_num_seqs=4))
    with_workers(router, FakeWorker(8, block_size=4))
    with pytest.raises(Rejected, match="beam_width 5 exceeds --max-num-seqs 4"):
        add_beam(router, "w", [1, 2], 4, 5)
    with pytest.raises(Rejected, match="needs 12 KV blocks for beam_width=4"):
        add_beam(router, "b", [1, 2], 10, 4)


ops = st.lists(st.tuples(st.sampled_from(["beam", "beam", "plain", "step", "steps", "abort", "lose"]),
                         st.integers(0, 10 ** 6)), min_size=1, max_size=40)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_block_invariant_and_answers_under_random_operations(operations):
    """Forks, drops, copies, preemptions (small pools), aborts and lost workers at random."""
    router = Router(RouterConfig(max_num_batched_tokens=20, max_num_seqs=8))
    workers = with_workers(router, FakeWorker(24, block_size=4), FakeWorker(40, block_size=4))
    out, beams, aborted = {}, {}, set()
    for i, (op, x) in enumerate(operations):
        rng = random.Random(x)
        if op in ("beam", "plain"):
            rid = f"r{i}"
            prompt = [rng.randrange(1, 990) for _ in range(rng.randrange(1, 10))]
            max_tokens = rng.randrange(1, 12)
            try:
                if op == "beam":
                    width, lp = rng.randrange(1, 5), rng.choice([1.0, 0.0, 2.0, -1.0])
                    early = rng.choice(["true", "false", "never"])
                    add_beam(router, rid, prompt, max_tokens, width, lp, early,
                             gateway=rng.choice([GW, b"gw2"]))
                    beams[rid] = (prompt, max_tokens, width, lp, early)
                else:
                    router.add(GW, pb.AddRequest(request_id=rid, prompt_token_ids=prompt,
                                                 max_tokens=max_tokens, sampling=pb.SamplingConfig()))
            except Rejected:
                pass
        elif op == "step":
            step(router, workers, out)
        elif op == "steps":
            for _ in range(rng.randrange(2, 15)):
                step(router, workers, out)
        else:
            abort_or_lose(router, workers, op, rng, sorted(beams), aborted)
        check(router)
    run(router, workers, out)
    for state in router.workers.values():
        assert not state.scheduler.requests and not state.scheduler.groups
        assert state.scheduler.kv.num_free == state.scheduler.kv.num_blocks
    for rid, (prompt, max_tokens, width, lp, early) in beams.items():
        if rid in aborted:
            continue
        if out.get((rid, 0), {}).get("error"):  # only when no worker left can hold it
            continue
        assert_matches(out, rid, prompt, max_tokens, width, lp, early)
