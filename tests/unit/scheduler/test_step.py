"""The step's seam (scheduler/step.py): a sequence taken into a step has its computed count moved
at once (so the next plan can follow this one), a step that reaches the end of its known tokens
samples one, which counts as pending until its result comes; the budget bounds what a step
takes; and the plan names new sequences whole and held ones by slot, in the order the result
answers them. A sequence's progress is written by the verbs of scheduler/progress.py only."""
from __future__ import annotations

import ast
from pathlib import Path

from proto import internal_pb2 as pb
from proto.columns import unpack_list
from scheduler.request import Request
from scheduler.step import Step


def request(prompt: list[int], slot: int = -1) -> Request:
    req = Request(seq_id="r#0", request_id="r", index=0, gateway=b"gw",
                  prompt_token_ids=prompt, sampling=pb.SamplingConfig(), max_tokens=8)
    req.slot, req.on_worker = slot, slot >= 0
    return req


def test_a_chunk_short_of_the_end_samples_nothing():
    step, req = Step(1, budget=16), request(list(range(10)))
    step.take(req, 6, [0, 1])
    assert req.num_computed_tokens == 6 and req.num_pending == 0 and step.budget == 10


def test_reaching_the_end_samples_one_token_that_is_pending_until_its_result():
    step, req = Step(1, budget=16), request(list(range(10)))
    step.take(req, 10, [0, 1, 2])
    assert req.num_computed_tokens == 10 and req.num_pending == 1
    later = Step(2, budget=16)  # the plan ahead: the pending token is the next one computed
    req.on_worker, req.slot = True, 3
    later.take(req, 1, [])
    assert req.num_computed_tokens == 11 and req.num_pending == 2


def test_the_plan_sends_new_sequences_whole_and_held_ones_by_slot_in_result_order():
    step = Step(1, budget=64)
    new, held = request([1, 2, 3], slot=-1), request([4, 5, 6, 7], slot=2)
    held.num_computed_tokens = 3
    step.take(held, 1, [9])
    step.take(new, 3, [0])
    new.slot = 5  # Slots.assign, when the scheduler sends it
    plan = step.plan()
    assert [(s.seq_id, s.slot, s.num_new_tokens, list(s.token_ids)) for s in plan.new_seqs] == \
        [("r#0", 5, 3, [1, 2, 3])]
    assert unpack_list(plan.running_slots) == [2] and unpack_list(plan.running_num_tokens) == [1]
    assert unpack_list(plan.new_block_slots) == [2] and unpack_list(plan.new_block_ids) == [9]
    assert [(r.slot, n) for r, n, _ in step.entries] == [(5, 3), (2, 1)]


def test_proposals_take_budget_and_a_step_of_block_moves_alone_is_not_empty():
    step, req = Step(1, budget=8), request([1, 2], slot=1)
    req.num_computed_tokens = 1
    step.take(req, 1, [])
    step.speculate(req, 3)
    assert step.budget == 4 and step.spec_slots == [1] and step.spec_num_tokens == [3]
    moves_only = Step(2, budget=8)
    assert moves_only.is_empty()
    moves_only.swap_in.append((0, 1))
    assert not moves_only.is_empty()


def test_progress_is_written_by_its_verbs_only():
    """num_computed_tokens and num_pending: assigned in scheduler/progress.py, nowhere else (the
    KV manager reads them and returns what it found)."""
    writers = set()
    for path in sorted((Path(__file__).resolve().parents[3] / "scheduler").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for t in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(t, ast.Attribute) and t.attr in ("num_computed_tokens",
                                                                     "num_pending"):
                        writers.add(path.name)
    assert writers == {"progress.py"}


def test_the_workers_sampling_is_built_for_the_plan_and_the_requests_left_as_it_came():
    step, req = Step(1, budget=16), request([1, 2, 3])
    req.sampling.min_tokens, req.stop_token_ids = 2, frozenset({9})
    req.set_limits(frozenset({0}), max_model_len=64)  # EOS 0
    step.take(req, 3, [0])
    req.slot = 1
    [new] = step.plan().new_seqs
    assert list(new.sampling.stop_token_ids) == [0, 9] and new.sampling.min_tokens == 2
    assert not req.sampling.stop_token_ids  # the gateway's, as it came
