"""The scheduler's seams for features to come, which have no behaviour yet: a request that waits
not ready (structured outputs will wait there for a compiled grammar) and lookahead slots in the
KV manager's allocation (speculative decoding's draft tokens)."""
from __future__ import annotations

from proto import internal_pb2 as pb
from scheduler.scheduler_config import SchedulerConfig
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import FinishReason, Request, Status
from scheduler.scheduler import Scheduler
from scheduler.single import Single


def request(rid: str, prompt: list[int], arrival: int = 0) -> Request:
    req = Request(seq_id=f"{rid}#0", request_id=rid, index=0, gateway=b"gw",
                  prompt_token_ids=prompt, sampling=pb.SamplingConfig(), max_tokens=4,
                  arrival=arrival)
    req.group = Single(req)
    return req


def planned(plan: pb.StepPlan | None) -> list[str]:
    return [s.seq_id for s in plan.new_seqs] if plan is not None else []


def test_a_request_not_ready_waits_unadmitted_until_marked_ready():
    sched = Scheduler(SchedulerConfig(block_size=4), num_blocks=16)
    early, late = request("early", [1, 2, 3, 4, 5]), request("late", [6, 7, 8], arrival=1)
    sched.add(early.group, ready=False)
    assert sched.schedule() is None  # nothing else to run, and it may not run
    assert early.status is Status.WAITING and sched.num_waiting == 1
    assert sched.kv.num_free == 16  # it holds no block while it waits
    sched.add(late.group)
    assert planned(sched.schedule()) == ["late#0"]  # the later one goes by it
    sched.mark_ready("early#0")
    assert planned(sched.schedule()) == ["early#0"]
    assert sched.num_waiting == 0 and early.status is Status.RUNNING


def test_a_request_aborted_while_not_ready_is_gone_and_marking_it_ready_does_nothing():
    sched = Scheduler(SchedulerConfig(block_size=4), num_blocks=16)
    req = request("r", [1, 2, 3])
    sched.add(req.group, ready=False)
    sched.abort("r#0")
    assert req.finish_reason is FinishReason.ABORT and sched.num_waiting == 0
    assert not sched.requests and not sched.groups and not sched.queues.not_ready
    sched.mark_ready("r#0")
    assert sched.schedule() is None and not sched.has_work


def test_lookahead_slots_get_blocks_but_count_as_nothing_computed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = request("r", [1, 2, 3, 4, 5, 6])
    assert kv.allocate_slots(req, 6, [], num_lookahead_tokens=3) is not None
    assert len(req.block_ids) == 3 and req.num_computed_tokens == 0  # 6 + 3 slots: 3 blocks
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 1, num_lookahead_tokens=2) == []  # 9 slots fit in 3 blocks
    assert len(kv.allocate_slots(req, 1, num_lookahead_tokens=6)) == 1  # 13: a fourth
    assert kv.allocate_slots(req, 1, num_lookahead_tokens=30) is None and len(req.block_ids) == 4
