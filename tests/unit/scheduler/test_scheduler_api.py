"""The scheduler's side of the public API, against the in-process fake worker: where answers end
(EOS, stop ids, min_tokens, ignore_eos), which workers may join, abort by public id, loads,
prompt logprobs and the per-request figures on the last delta."""
from __future__ import annotations

import pytest

from proto import internal_pb2 as pb
from proto.columns import unpack_list
from proto.token_stream import updates
from scheduler.router import Rejected
from tests.fake_worker import EOS, EOS_MARK, FakeWorker, reference_output
from tests.unit.scheduler.test_scheduler import GW, check, make_router, run, step, with_workers


def add(router, rid, prompt, max_tokens, min_tokens=0, public_id="", gateway=GW, **kw):
    router.add(gateway, pb.AddRequest(
        request_id=rid, public_id=public_id, prompt_token_ids=prompt, max_tokens=max_tokens,
        sampling=pb.SamplingConfig(min_tokens=min_tokens), **kw))


def test_eos_at_a_chosen_position_ends_with_stop():
    router = make_router()
    workers = with_workers(router, FakeWorker(64))
    prompts = {f"r{k}": [EOS_MARK, k, 5, 6, 7] for k in (1, 3, 9)}
    for rid, prompt in prompts.items():
        add(router, rid, prompt, 20)
    add(router, "plain", [5, 6, 7], 12)
    out = {}
    run(router, workers, out)
    for rid, prompt in prompts.items():
        tokens = out[(rid, 0)]["tokens"]
        assert tokens == reference_output(prompt, 20)
        assert len(tokens) == prompt[1] and tokens[-1] == EOS
        assert out[(rid, 0)]["finish"] == pb.STOP
    assert len(out[("plain", 0)]["tokens"]) == 12 and out[("plain", 0)]["finish"] == pb.LENGTH


def test_min_tokens_holds_eos_and_stop_ids_back():
    router = make_router()
    workers = with_workers(router, FakeWorker(64))
    prompt = [EOS_MARK, 2, 11, 12]
    first_tokens = reference_output([11, 12, 13], 3)
    add(router, "eos", prompt, 20, min_tokens=6)
    # A stop id the fake model samples as output token 1: min_tokens 3 must not stop there.
    add(router, "stopid", [11, 12, 13], 20, min_tokens=3, stop_token_ids=[first_tokens[0]])
    out = {}
    run(router, workers, out)
    eos = out[("eos", 0)]["tokens"]
    assert eos == reference_output(prompt, 20, min_tokens=6) and len(eos) == 7 and eos[-1] == EOS
    stop = out[("stopid", 0)]["tokens"]
    assert stop == reference_output([11, 12, 13], 20, min_tokens=3, stop_token_ids=[first_tokens[0]])
    assert stop[0] == first_tokens[0] and len(stop) > 3
    assert out[("stopid", 0)]["finish"] == (pb.STOP if stop[-1] == first_tokens[0] else pb.LENGTH)


def test_min_tokens_tells_the_worker_what_to_mask():
    router = make_router()
    workers = with_workers(router, FakeWorker(64))
    add(router, "m", [1, 2, 3], 8, min_tokens=2, stop_token_ids=[77])
    add(router, "plain", [1, 2, 4], 8, stop_token_ids=[77])
    seen = []
    step(router, workers, {}, seen)
    sampling = {s.seq_id: s.sampling for s in seen[0].new_seqs}
    assert sorted(sampling["m#0"].stop_token_ids) == [EOS, 77]
    assert list(sampling["plain#0"].stop_token_ids) == []  # nothing to mask without min_tokens


def test_ignore_eos_runs_through_eos_to_length():
    router = make_router()
    workers = with_workers(router, FakeWorker(64))
    add(router, "x", [EOS_MARK, 2, 5], 6, ignore_eos=True)
    out = {}
    run(router, workers, out)
    tokens = out[("x", 0)]["tokens"]
    assert tokens == reference_output([EOS_MARK, 2, 5], 6, ignore_eos=True)
    assert tokens[1] == EOS and len(tokens) == 6 and out[("x", 0)]["finish"] == pb.LENGTH


def test_hello_without_eos_or_with_other_eos_is_refused():
    router = make_router()
    silent = FakeWorker(8).hello()
    del silent.eos_token_ids[:]
    assert "eos_token_ids" in router.refusal(b"a", silent)
    none = FakeWorker(8).hello()
    del none.eos_token_ids[:]
    none.no_eos = True
    assert router.refusal(b"a", none) is None
    router.register(b"w0", FakeWorker(8).hello())
    assert list(router.cluster_info().eos_token_ids) == [EOS]
    other = FakeWorker(8).hello()
    other.eos_token_ids[:] = [EOS, 5]
    assert "differ" in router.refusal(b"w1", other)
    assert router.refusal(b"w1", FakeWorker(8).hello()) is None
    assert router.refusal(b"w0", other) is None  # the only worker may re-register as it likes


def test_abort_by_public_id_ends_the_stream_with_abort_and_frees_blocks():
    router = make_router()
    workers = with_workers(router, FakeWorker(64))
    add(router, "gw1-0", [1, 2, 3], 50, public_id="mine", gateway=b"g1")
    add(router, "gw2-0", [4, 5, 6], 50, public_id="theirs", gateway=b"g2", n=2)
    out = {}
    for _ in range(3):
        step(router, workers, out)
    assert router.abort_public(["theirs", "nobody"]) == ["theirs"]
    deltas = router.take_outbox()
    finished = [(d.request_id, d.index, d.finish) for d in deltas[b"g2"].deltas]
    assert finished == [("gw2-0", 0, pb.ABORT), ("gw2-0", 1, pb.ABORT)]
    assert b"g1" not in deltas
    check(router)
    assert router.abort_public(["theirs"]) == []  # already over
    run(router, workers, out)
    kv = next(iter(router.workers.values())).scheduler.kv
    assert kv.num_free == kv.num_blocks


def test_public_ids_are_unique_while_in_flight():
    router = make_router()
    workers = with_workers(router, FakeWorker(64))
    add(router, "a-0", [1, 2, 3], 3, public_id="same")
    with pytest.raises(Rejected) as err:
        add(router, "b-0", [1, 2, 3], 3, public_id="same", gateway=b"other")
    assert err.value.code == "ALREADY_EXISTS"
    run(router, workers, {})
    add(router, "b-1", [1, 2, 3], 3, public_id="same")  # free again once the first ended


def test_loads_report_queues_and_kv_usage():
    router = make_router(max_num_seqs=2)
    workers = with_workers(router, FakeWorker(64, worker_id="fake-0"))
    for i in range(4):
        add(router, f"r{i}", [1, 2, 3, 4, 5, i + 10], 30)
    step(router, workers, {})
    loads = router.loads()
    (w,) = loads.workers
    assert (w.worker_id, w.running, w.waiting, w.swapped) == ("fake-0", 2, 2, 0)
    assert w.kv_blocks_total == 64 and w.kv_blocks_used == 4  # 6 tokens = 2 blocks of 4, twice
    assert loads.num_pending == 0
    run(router, workers, {})
    add(router, "again", [1, 2, 3, 4, 5, 99], 3)  # its first block is cached by now
    run(router, workers, {})
    kv = router.workers[b"w0"].scheduler.kv
    queries, hits = kv.prefix_stats()
    assert router.loads().workers[0].prefix_cache_hit_rate == pytest.approx(hits / queries)
    assert 0 < hits < queries


def test_prompt_logprobs_skip_the_prefix_cache():
    router = make_router()
    workers = with_workers(router, FakeWorker(64))
    prompt = list(range(1, 14))
    add(router, "warm", prompt, 2)
    run(router, workers, {})
    out = {}
    add(router, "cached", prompt, 2)
    router.add(GW, pb.AddRequest(request_id="scored", prompt_token_ids=prompt, max_tokens=2,
                                 sampling=pb.SamplingConfig(prompt_logprobs=0)))
    run(router, workers, out)
    assert out[("cached", 0)]["cached"] == 12
    assert out[("scored", 0)]["cached"] == 0


def test_last_delta_reports_queue_time_and_preemptions():
    router = make_router(max_num_batched_tokens=64)
    workers = with_workers(router, FakeWorker(6, block_size=4))
    for i in range(3):
        add(router, f"r{i}", [i + 1] * 4, 12)
    finals = {}
    for _ in range(200):
        plans = router.plans()
        for wid, plan in plans:
            router.on_result(wid, workers[wid].execute(plan))
        for msg in router.take_outbox().values():
            finals.update({d.request_id: d for d in msg.deltas if d.finish})
        if not plans:
            break
    assert set(finals) == {"r0", "r1", "r2"}
    assert sum(d.num_preemptions for d in finals.values()) >= 1  # 3 x 4 blocks do not fit in 6
    assert all(d.queue_time_s >= 0 for d in finals.values())
    assert max(d.queue_time_s for d in finals.values()) > 0


def test_one_plan_ahead_drops_the_token_computed_after_a_stop():
    router = make_router()
    fake = FakeWorker(64)
    workers = with_workers(router, fake)
    add(router, "e", [EOS_MARK, 3, 5, 6], 20)
    sched = router.workers[b"w0"].scheduler
    plans, out, depth = [], {}, 0
    while step(router, workers, out, plans):
        depth = max(depth, len(sched.in_flight) + len(fake.inbox))
    assert depth == 2  # the next plan went out before the previous result came back
    # Output token 3 is EOS; the plan sent before that result was known computed once more.
    slot = plans[0].new_seqs[0].slot
    decodes = [p for p in plans if slot in unpack_list(p.running_slots)]
    assert len(decodes) == 3  # outputs 2 and 3 as planned, plus the one after the stop
    assert out[("e", 0)]["tokens"] == reference_output([EOS_MARK, 3, 5, 6], 20)
    assert len(out[("e", 0)]["tokens"]) == 3 and out[("e", 0)]["finish"] == pb.STOP
    assert sched.kv.num_free == 64 and not sched.requests


def test_length_is_known_ahead_and_costs_no_extra_step():
    router = make_router()
    workers = with_workers(router, FakeWorker(64))
    add(router, "l", [5, 6, 7], 4)
    plans, out = [], {}
    run(router, workers, out, plans_seen=plans)
    computed = sum(s.num_new_tokens for p in plans for s in p.new_seqs)
    computed += sum(sum(unpack_list(p.running_num_tokens)) for p in plans)
    assert computed == 3 + 3  # the prompt, then outputs 1..3 as inputs; output 4 ends it
    assert out[("l", 0)]["tokens"] == reference_output([5, 6, 7], 4)


@pytest.mark.parametrize("n", [1, 3])
def test_a_final_only_request_sends_its_tokens_with_its_finish_alone(n):
    """AddRequest.final_only: no token of it goes out step by step; its finish carries them all,
    the usage figures and the time to its first token, while its streamed twin beside it sends
    a token every step, the same tokens."""
    import time
    router = make_router()
    workers = with_workers(router, FakeWorker(64))
    started = time.monotonic()
    add(router, "whole", [5, 6, 7, 8], 12, final_only=True, n=n)
    add(router, "twin", [5, 6, 7, 8], 12, n=n)
    messages = []
    for _ in range(200):
        plans = router.plans()
        for wid, plan in plans:
            router.on_result(wid, workers[wid].execute(plan))
        messages += router.take_outbox().values()
        if not plans:
            break
    elapsed = time.monotonic() - started
    carrying = {"whole": 0, "twin": 0}
    tokens: dict[tuple[str, int], list[int]] = {}
    for msg in messages:
        for rid in set(msg.request_ids) | {d.request_id for d in msg.deltas}:
            carrying[rid] += 1
        for u in updates(msg):
            tokens.setdefault((u.request_id, u.index), []).extend(u.token_ids)
    assert carrying["whole"] == 1 and carrying["twin"] >= 12
    assert tokens[("whole", 0)] == reference_output([5, 6, 7, 8], 12)
    for i in range(n):
        assert tokens[("whole", i)] == tokens[("twin", i)] and len(tokens[("whole", i)]) == 12
    finals = [d for msg in messages for d in msg.deltas if d.request_id == "whole"]
    assert len(finals) == n and all(d.finish == pb.LENGTH and d.prompt_tokens == 4 for d in finals)
    assert all(0 < d.first_token_s <= elapsed for d in finals)
    assert all(d.first_token_s == 0 for msg in messages for d in msg.deltas if d.request_id == "twin")
