"""The groups' seam (scheduler/sequence_group.py): every kind is admitted by the one admission
helper, all or nothing; forks share their parent's blocks from the token they fork at; results
reach a group through its own verbs (on_logprobs, on_sampled, settle, report_end), so no caller
asks which kind it has; and no kind writes a status: the queues' verbs do."""
from __future__ import annotations

import ast
from pathlib import Path

from proto import internal_pb2 as pb, pagoda_pb2
from proto.columns import pack, pack_f32
from scheduler.beam_search import BeamSearch
from scheduler.forks import Forks
from scheduler.request import Request, Status
from scheduler.scheduler import Scheduler
from scheduler.scheduler_config import SchedulerConfig
from scheduler.sequence_group import admit_whole
from scheduler.single import Single
from scheduler.step import Step

PACKAGE = Path(__file__).resolve().parents[3] / "scheduler"
BLOCK = 4


def request(rid: str, prompt: list[int], index: int = 0) -> Request:
    req = Request(seq_id=f"{rid}#{index}", request_id=rid, index=index, gateway=b"gw",
                  prompt_token_ids=prompt, sampling=pb.SamplingConfig(), max_tokens=8)
    req.group = Single(req)
    return req


def scheduler(num_blocks: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(block_size=BLOCK, eos_token_ids=frozenset({0})), num_blocks)


def test_admission_is_all_or_nothing():
    sched = scheduler(num_blocks=4)
    a, b = request("a", list(range(1, 10))), request("b", list(range(11, 20)))  # 3 blocks each
    for req in (a, b):
        sched.add_sequence(req)
    assert admit_whole(sched, a.group, [a, b], Step(1, 64)) is None
    assert a.status is b.status is Status.WAITING
    assert not a.block_ids and not b.block_ids and a.num_computed_tokens == 0
    assert sched.kv.num_free == 4
    assert admit_whole(sched, a.group, [a], Step(2, 64)) == [(a, 9)]
    assert a.status is Status.RUNNING and len(a.block_ids) == 3


def test_forks_compute_the_prompt_once_and_share_its_blocks_from_the_last_token():
    sched = scheduler()
    prompt = list(range(1, 10))
    parent, children = request("f", prompt), [request("f", prompt, i) for i in (1, 2)]
    group = Forks(parent, children=children)
    sched.add(group)
    sched.schedule()  # the parent alone, one token short of its prompt
    assert parent.num_computed_tokens == 8 and all(c.status is Status.WAITING for c in children)
    plan = sched.schedule()  # the fork: the last token, computed by each
    assert [s.seq_id for s in plan.new_seqs] == ["f#1", "f#2"]
    assert all(c.status is Status.RUNNING and c.num_computed_tokens == 9 for c in children)
    assert [sched.kv.ref_count(b) for b in parent.block_ids[:2]] == [3, 3]  # full blocks shared
    assert all(isinstance(c.group, Single) for c in children) and not group.children


def test_a_plain_sequence_accepts_its_sampled_token_and_streams_it():
    sched = scheduler()
    req = request("r", [5, 6, 7])
    sched.add(req.group)
    sched.schedule()
    req.num_pending -= 1  # results accept it: the token is no longer on the way
    assert req.group.on_sampled(sched, req, [9]) is False  # nothing to settle
    assert req.all_token_ids == [5, 6, 7, 9] and req.stream.sent == 1
    req.group.on_sampled(sched, req, [0])  # EOS
    assert req.status is Status.FINISHED and req.stream.ended


def test_a_beam_search_picks_its_tokens_from_its_candidates():
    sched = scheduler()
    handle = request("b", [5, 6, 7])
    group = BeamSearch.of(handle, pagoda_pb2.BeamSearchParams(beam_width=2))
    sched.add(group)
    sched.schedule()
    beam0 = group.beams[0]
    beam0.num_pending -= 1
    assert group.on_sampled(sched, beam0, [9]) is False  # no candidates yet: nothing to settle
    group.on_logprobs(sched, beam0, pb.SlotLogprobs(k=4, top_token_ids=pack([11, 12, 13, 14]),
                                                top_logprobs=pack_f32([-1, -2, -3, -4])))
    assert group.on_sampled(sched, beam0, [9]) is True
    assert group.settle(sched) is False  # the search goes on, with two beams
    assert [b.all_token_ids[-1] for b in group.beams] == [11, 12]
    assert beam0.all_token_ids == [5, 6, 7, 11]  # the worker's own 9 is not the beam's


def assigned_attributes(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AugAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            for t in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(t, ast.Attribute)}


def test_no_kind_writes_a_status():
    for module in ("sequence_group", "single", "forks", "beam_search"):
        assert "status" not in assigned_attributes(module), module


def test_no_caller_asks_which_kind_a_group_is():
    for module in ("results", "scheduler", "router", "stream"):
        source = (PACKAGE / f"{module}.py").read_text()
        assert "isinstance" not in source and "picks_tokens" not in source, module
