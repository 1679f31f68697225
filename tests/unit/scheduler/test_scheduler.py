"""Scheduler policy against an in-process fake worker: outputs must equal an uncached reference,
and the block invariant must hold after every operation."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from proto import internal_pb2 as pb
from proto.columns import unpack_list
from proto.token_stream import updates
from scheduler.request import Status
from scheduler.router import Rejected, Router, RouterConfig
from tests.fake_worker import EOS, EOS_MARK, FakeWorker, reference_output

GW = b"gw"


def make_router(**kw) -> Router:
    return Router(RouterConfig(**kw))


def add(router, rid, prompt, max_tokens, **kw):
    router.add(GW, pb.AddRequest(request_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens,
                                 sampling=pb.SamplingConfig(), **kw))


def check(router):
    for state in router.workers.values():
        sched = state.scheduler
        sched.kv.check_invariant(sched.requests.values())
        for req in sched.requests.values():
            assert not req.is_finished
        assert sched.num_waiting == sum(r.status is Status.WAITING for r in sched.requests.values())
        assert len(sched.running) <= sched.config.max_num_seqs


def step(router, workers, outputs, plans_seen=None, collect_fn=None):
    """As the real loop runs: every worker gets plans up to the scheduler's plans in flight
    (one ahead), then each executes its oldest and the result comes back; collect_fn (default
    collect) reads the streams."""
    while True:
        sent = router.plans()
        if not sent:
            break
        for wid, plan in sent:
            if plans_seen is not None:
                plans_seen.append(plan)
            workers[wid].inbox.append(plan)
    busy = False
    for wid, worker in workers.items():
        if worker.inbox:
            busy = True
            router.on_result(wid, worker.execute(worker.inbox.popleft()))
            check(router)
    (collect_fn or collect)(router, outputs)
    return busy


def collect(router, outputs):
    for u in [u for msg in router.take_outbox().values() for u in updates(msg)]:
        entry = outputs.setdefault((u.request_id, u.index), {"tokens": [], "finish": 0})
        entry["tokens"] += u.token_ids
        entry.setdefault("error", "")
        delta = u.news if u.news is not None else pb.TokenDelta()
        if delta.finish:
            entry["finish"] = delta.finish
            entry["cached"] = delta.cached_prompt_tokens
            entry["error"] = delta.error.code
            entry["message"] = delta.error.message


def run(router, workers, outputs, max_steps=10000, plans_seen=None, collect_fn=None):
    for _ in range(max_steps):
        if not step(router, workers, outputs, plans_seen, collect_fn):
            return
    raise AssertionError("did not finish")


def with_workers(router, *workers):
    table = {}
    for i, w in enumerate(workers):
        wid = f"w{i}".encode()
        router.register(wid, w.hello())
        table[wid] = w
    return table


def test_single_request_matches_reference():
    router = make_router()
    workers = with_workers(router, FakeWorker(64))
    add(router, "a", [5, 6, 7, 8, 9], 12)
    out = {}
    run(router, workers, out)
    assert out[("a", 0)]["tokens"] == reference_output([5, 6, 7, 8, 9], 12)
    assert out[("a", 0)]["finish"] == pb.LENGTH
    kv = router.workers[b"w0"].scheduler.kv
    assert kv.num_free == kv.num_blocks  # freed the moment it finished


def test_chunked_prefill_respects_budget_and_decodes_keep_running():
    router = make_router(max_num_batched_tokens=32)
    workers = with_workers(router, FakeWorker(256))
    for i in range(4):
        add(router, f"d{i}", [i + 1] * 3, 40)
    out, plans = {}, []
    for _ in range(3):
        step(router, workers, out, plans)
    add(router, "long", list(range(1, 200)), 4)
    run(router, workers, out, plans_seen=plans)
    for plan in plans:
        assert sum(s.num_new_tokens for s in plan.new_seqs) + sum(unpack_list(plan.running_num_tokens)) <= 32
    # While the long prompt is prefilled in chunks, every decoding stream still gets its token.
    long_slot = next(s.slot for p in plans for s in p.new_seqs if s.seq_id == "long#0")
    first = next(i for i, p in enumerate(plans) if any(s.seq_id == "long#0" for s in p.new_seqs))
    long_steps = [plans[first]] + [p for p in plans[first + 1:] if any(
        slot == long_slot and n > 1 for slot, n in zip(unpack_list(p.running_slots), unpack_list(p.running_num_tokens)))]
    assert len(long_steps) >= 199 // 32
    for p in long_steps:
        decodes = [slot for slot, n in zip(unpack_list(p.running_slots), unpack_list(p.running_num_tokens)) if n == 1]
        assert len(decodes) == 4
    assert out[("long", 0)]["tokens"] == reference_output(list(range(1, 200)), 4)
    for i in range(4):
        assert out[(f"d{i}", 0)]["tokens"] == reference_output([i + 1] * 3, 40)


@pytest.mark.parametrize("mode,cpu_blocks", [("recompute", 0), ("swap", 40)])
def test_preemption_gives_the_undisturbed_output(mode, cpu_blocks):
    router = make_router()
    # 48 slots for 6 x ~20 tokens: preemption is certain.
    workers = with_workers(router, FakeWorker(12, block_size=4, num_cpu_blocks=cpu_blocks))
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(1, 1000) for _ in range(rng.randrange(3, 9))] for i in range(6)}
    for rid, p in prompts.items():
        add(router, rid, p, 12)
    out = {}
    run(router, workers, out)
    sched = router.workers[b"w0"].scheduler
    assert sched.stats.num_preemptions[mode] > 0
    for rid, p in prompts.items():
        assert out[(rid, 0)]["tokens"] == reference_output(p, 12), rid
    assert sched.kv.num_cpu_free == cpu_blocks


def test_prefix_cache_hit_is_reported_and_correct():
    router = make_router()
    workers = with_workers(router, FakeWorker(128, block_size=4))
    system = list(range(1, 41))  # 40 tokens = 10 full blocks
    add(router, "first", system + [900, 901], 5)
    out = {}
    run(router, workers, out)
    add(router, "second", system + [902], 5)
    run(router, workers, out)
    assert out[("first", 0)]["cached"] == 0
    assert out[("second", 0)]["cached"] == 40
    assert out[("second", 0)]["tokens"] == reference_output(system + [902], 5)
    # A hit never covers the whole prompt, even when the prompt is exactly cached blocks.
    add(router, "third", system, 3)
    run(router, workers, out)
    assert out[("third", 0)]["cached"] == 36
    assert out[("third", 0)]["tokens"] == reference_output(system, 3)


def test_priority_runs_lower_first_and_fcfs_within():
    router = make_router(max_num_seqs=1)
    workers = with_workers(router, FakeWorker(64))
    add(router, "low", [1, 2], 2, priority=5)
    add(router, "high", [3, 4], 2, priority=-1)
    add(router, "high2", [5, 6], 2, priority=-1)
    order = []
    while True:
        plans = router.plans()
        if not plans:
            break
        for wid, plan in plans:
            order += [s.seq_id for s in plan.new_seqs]
            router.on_result(wid, workers[wid].execute(plan))
    assert order == ["high#0", "high2#0", "low#0"]


def test_rejections_and_queue_bound():
    router = make_router(max_waiting_requests=3)
    with_workers(router, FakeWorker(8, block_size=4))  # 32 slots
    with pytest.raises(Rejected) as e:
        add(router, "big", [1] * 20, 20)
    assert e.value.code == "INVALID_ARGUMENT" and "KV blocks" in e.value.message
    for i in range(3):
        add(router, f"q{i}", [1, 2], 2)
    with pytest.raises(Rejected) as e:
        add(router, "q3", [1, 2], 2)
    assert e.value.code == "RESOURCE_EXHAUSTED"


def test_worker_loss_requeues_and_output_continues():
    router = make_router()
    w0, w1 = FakeWorker(64, worker_id="a"), FakeWorker(64, worker_id="b")
    workers = with_workers(router, w0)
    add(router, "x", [7, 8, 9], 20)
    out = {}
    for _ in range(6):
        step(router, workers, out)
    router.remove(b"w0", "test")
    assert router.pending  # nobody to run it
    workers = {b"w1": w1}
    router.register(b"w1", w1.hello())
    run(router, workers, out)
    assert out[("x", 0)]["tokens"] == reference_output([7, 8, 9], 20)


def abort_or_lose(router, workers, op, rng, victims, aborted) -> None:
    """The random operations' "abort" (of one of victims, a sequence) and "lose" (of a worker,
    while another is left)."""
    if op == "abort" and victims:
        victim = rng.choice(victims)
        aborted.add(victim)
        router.abort(victim)
    elif op == "lose" and len(router.workers) > 1:
        wid = rng.choice(sorted(router.workers))
        router.remove(wid, "test")
        workers[wid].inbox.clear()


ops = st.lists(st.tuples(st.sampled_from(["add", "add_n", "step", "step", "steps", "abort", "lose"]),
                         st.integers(0, 10 ** 6)), min_size=1, max_size=60)
# A tenth of the fake model's tokens: some sequences end on a stop token, most run to length.
STOPS = random.Random(0).sample(range(1, 1000), 100)


# Speculation (proposals each worker may verify a step): none, and workers that speculate (one
# plan at a time, lookahead slots, runs of tokens in a result) beside one that does not.
@pytest.mark.parametrize("speculate", [(0, 0), (3, 0), (4, 2)])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=ops)
# A sequence that learned a draft length of 4 on one worker, recomputed on one whose k is 2.
@example(operations=[("add", 100000), ("steps", 1), ("lose", 1)])
def test_block_invariant_under_random_operations(speculate, operations):
    router = make_router(max_num_batched_tokens=24, max_num_seqs=6)
    workers = with_workers(router, FakeWorker(10, block_size=4, num_cpu_blocks=8,
                                              num_speculative_tokens=speculate[0]),
                           FakeWorker(14, block_size=4, num_speculative_tokens=speculate[1]))
    out, ids, prompts, aborted = {}, [], {}, set()
    for op, x in operations:
        rng = random.Random(x)
        if op in ("add", "add_n"):
            rid = f"r{len(ids)}"
            shared = [1, 2, 3, 4, 5, 6, 7, 8] if rng.random() < 0.5 else []
            prompt = shared + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 12))]
            n = rng.randrange(2, 4) if op == "add_n" else 1
            stops = STOPS if rng.random() < 0.3 else []
            # Two gateways, so that streamed tokens must reach the right one.
            gateway = GW if rng.random() < 0.7 else b"gw2"
            if rng.random() < 0.3:  # the fake model ends it with EOS at a chosen output index
                prompt = [EOS_MARK, rng.randrange(1, 12)] + prompt
            max_tokens = rng.randrange(1, 12 if rng.random() < 0.7 else 40)
            try:
                router.add(gateway, pb.AddRequest(
                    request_id=rid, prompt_token_ids=prompt, n=n, stop_token_ids=stops,
                    max_tokens=max_tokens, sampling=pb.SamplingConfig(has_seed=True, seed=x)))
                ids.append(rid)
                prompts[rid] = (prompt, x, set(stops), max_tokens)
            except Rejected:
                pass
        elif op == "step":
            step(router, workers, out)
        elif op == "steps":  # quiet stretches, one plan ahead
            for _ in range(rng.randrange(2, 20)):
                step(router, workers, out)
        else:
            abort_or_lose(router, workers, op, rng, ids, aborted)
        check(router)
    run(router, workers, out)
    check(router)
    for state in router.workers.values():
        assert not state.scheduler.requests
        assert state.scheduler.kv.num_free == state.scheduler.kv.num_blocks
    for (rid, index), entry in out.items():
        prompt, seed, stops, max_tokens = prompts[rid]
        tokens = entry["tokens"]
        if rid in aborted:  # whatever it streamed before the abort is the undisturbed run's start
            assert tokens == reference_output(prompt, max_tokens, seed + index, stop_token_ids=stops)[:len(tokens)]
            continue
        expected = reference_output(prompt, max_tokens, seed + index, stop_token_ids=stops)
        if entry["error"]:  # only when the worker that could hold it was lost
            assert entry["error"] == "RESOURCE_EXHAUSTED"
            need = -(-(len(prompt) + max_tokens) // 4)
            assert all(need > w.scheduler.kv.num_blocks for w in router.workers.values())
            assert tokens == expected[:len(tokens)]
            continue
        assert tokens == expected
        ended_on_stop = expected[-1] in stops | {EOS}
        assert entry["finish"] == (pb.STOP if ended_on_stop else pb.LENGTH)
    for state in router.workers.values():
        assert state.scheduler.kv.num_cpu_free == state.hello.num_cpu_blocks


def test_parallel_sampling_shares_the_prompt_and_copies_on_write():
    router = make_router()
    worker = FakeWorker(64, block_size=4)
    workers = with_workers(router, worker)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks and a partial one
    router.add(GW, pb.AddRequest(request_id="p", prompt_token_ids=prompt, max_tokens=6, n=3,
                                 sampling=pb.SamplingConfig(has_seed=True, seed=42)))
    out, plans = {}, []
    step(router, workers, out, plans)
    step(router, workers, out, plans)
    sched = router.workers[b"w0"].scheduler
    seqs = [sched.requests[f"p#{i}"] for i in range(3)]
    assert seqs[0].block_ids[:2] == seqs[1].block_ids[:2] == seqs[2].block_ids[:2]
    assert sched.kv.ref_count(seqs[0].block_ids[0]) == 3
    assert len({s.block_ids[2] for s in seqs}) == 3  # the partial block was copied, not shared
    run(router, workers, out, plans_seen=plans)
    assert worker.copies == 2
    computed = sum(s.num_new_tokens for p in plans for s in p.new_seqs)
    computed += sum(sum(unpack_list(p.running_num_tokens)) for p in plans)
    assert computed == len(prompt) + 2 + 3 * 5  # prompt once, the last token per child, decodes
    for i in range(3):
        assert out[("p", i)]["tokens"] == reference_output(prompt, 6, seed=42 + i)
    assert len({tuple(out[("p", i)]["tokens"]) for i in range(3)}) == 3


def test_aborting_one_index_frees_its_blocks_and_the_others_go_on():
    router = make_router()
    workers = with_workers(router, FakeWorker(64, block_size=4))
    prompt = list(range(1, 11))
    router.add(GW, pb.AddRequest(request_id="p", prompt_token_ids=prompt, max_tokens=8, n=3,
                                 sampling=pb.SamplingConfig(has_seed=True, seed=3)))
    out = {}
    for _ in range(4):
        step(router, workers, out)
    sched = router.workers[b"w0"].scheduler
    used = sched.kv.num_used
    router.abort("p", {1})
    check(router)
    assert sched.kv.num_used < used and "p#1" not in sched.requests
    run(router, workers, out)
    for i in (0, 2):
        assert out[("p", i)]["tokens"] == reference_output(prompt, 8, seed=3 + i)
    assert out[("p", 1)]["finish"] == 0  # aborted: no finish delta, the gateway already ended it
    assert "p" not in router.seqs and sched.kv.num_free == sched.kv.num_blocks


def test_metrics_report_steps_forward_time_and_queues():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from scheduler.metrics import RouterCollector

    router = make_router(max_num_seqs=2)
    fake = FakeWorker(64)
    with_workers(router, fake)
    for i in range(4):
        add(router, f"m{i}", [i + 1] * 5, 6)
    registry = CollectorRegistry()
    registry.register(RouterCollector(router))

    def read():
        text = generate_latest(registry).decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    assert read()["pagoda_num_requests_waiting"] == 4
    plans, seconds = 0, 0.0
    while router.workers[b"w0"].scheduler.has_work:
        for wid, plan in router.plans():
            result = fake.execute(plan)
            result.forward_seconds = 0.25 * (plans % 3)  # any values: the sum must come back
            seconds += result.forward_seconds
            plans += 1
            router.on_result(wid, result)
        m = read()
        assert m["pagoda_num_requests_running"] <= 2
        assert m["pagoda_num_requests_waiting"] + m["pagoda_num_requests_running"] == len(
            router.workers[b"w0"].scheduler.requests)
        router.take_outbox()
    m = read()
    assert m["pagoda_worker_steps_total"] == plans == fake.steps
    assert m["pagoda_worker_forward_seconds_total"] == pytest.approx(seconds)
    assert m["pagoda_num_requests_waiting"] == 0 and m["pagoda_kv_blocks_free"] == 64


def test_abort_while_a_step_runs_skips_only_that_sequence():
    router = make_router()
    fake = FakeWorker(64)
    workers = with_workers(router, fake)
    prompts = {f"q{i}": [i + 2] * 7 for i in range(3)}
    for rid, prompt in prompts.items():
        add(router, rid, prompt, 20)
    out = {}
    for _ in range(5):
        step(router, workers, out)
    sched = router.workers[b"w0"].scheduler
    assert len(sched.in_flight) == 1 and len(fake.inbox) == 1  # one plan runs, q1 in it
    free, held = sched.kv.num_free, len(sched.requests["q1#0"].block_ids)
    streamed = len(out[("q1", 0)]["tokens"])
    router.abort("q1")  # the gateway's abort arrives while the worker computes
    assert held > 0 and sched.kv.num_free == free + held  # freed at once, not after the step
    run(router, workers, out)
    assert out[("q0", 0)]["tokens"] == reference_output(prompts["q0"], 20)
    assert out[("q2", 0)]["tokens"] == reference_output(prompts["q2"], 20)
    assert out[("q1", 0)]["tokens"] == reference_output(prompts["q1"], 20)[:streamed]  # nothing after
    assert sched.kv.num_free == 64 and not sched.requests
