"""The step pipeline's rule: a feature is a hook, called at the pipeline's named points in its
fixed order, and a hook with a per-row column of its own takes part in the step without an edit
to the pipeline. A stand-in model (hidden states = one-hot input ids, logits = the hidden states)
keeps the step to the pipeline alone."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from proto import internal_pb2
from proto.columns import pack, unpack_list
from worker.step.input_batch import InputBatch
from worker.parallel.tensor_parallel import TensorParallel
from worker.step.sampler import Sampler
from worker.step.hook import Step, StepHook
from worker.step.pipeline import StepPipeline

VOCAB = 64


class OneHotModel:
    """Greedy sampling returns each row's last input token; the greedy fast path is absent."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def __call__(self, input_ids, positions, meta, kv_caches):
        if self.fail:
            raise RuntimeError("the forward failed")
        return torch.nn.functional.one_hot(input_ids, VOCAB).float()

    def compute_logits(self, hidden):
        return hidden

    def greedy_tokens(self, hidden):
        return None


class NoCache:
    kv_caches = ()

    def swap_out(self, pairs): ...
    def swap_in(self, pairs): ...
    def copy(self, pairs): ...


class AdapterColumn(StepHook):
    """A per-row feature as a new one would be written: its column (an adapter index per slot,
    from the request's seed here), the stages it is called at, in order, and a mask that leaves
    each row one token: its adapter's."""

    def __init__(self) -> None:
        self.adapter = np.zeros(16, np.int64)
        self.calls: list[str] = []
        self.seen: list[list[int]] = []

    def drop(self, slots) -> None:
        self.calls.append("drop")

    def add(self, new, sampling) -> None:
        self.calls.append("add")
        self.adapter[new.slot] = sampling.seed

    def apply_plan(self, step: Step) -> None:
        self.calls.append("apply_plan")

    def prepare(self, step: Step) -> None:
        self.calls.append("prepare")
        self.seen.append(self.adapter[step.slots].tolist())

    def undo(self, step: Step) -> None:
        self.calls.append("undo")

    def needs_logits(self, step: Step) -> bool:
        self.calls.append("needs_logits")
        return True

    def mask(self, step: Step):
        self.calls.append("mask")
        bitmask = torch.zeros(len(step.sampled_slots), VOCAB // 32, dtype=torch.int32)
        for row, token in enumerate(self.adapter[step.sampled_slots].tolist()):
            bitmask[row, token // 32] = 1 << (token % 32)
        return list(range(len(step.sampled_slots))), bitmask

    def after_sample(self, step: Step) -> None:
        self.calls.append("after_sample")

    def settle(self, step: Step) -> None:
        self.calls.append("settle")

    def accept(self, step: Step) -> None:
        self.calls.append("accept")

    def forget(self) -> None:
        self.calls.append("forget")


def pipeline(hooks, model=None) -> StepPipeline:
    return StepPipeline(model or OneHotModel(), NoCache(), Sampler(torch.Generator().manual_seed(0)),
                        TensorParallel(), lambda slots, counts, batch: batch.prepare(slots, counts),
                        lambda: InputBatch(32, 4), hooks)


def new_seq(slot: int, tokens: list[int], adapter: int) -> internal_pb2.NewSeq:
    return internal_pb2.NewSeq(seq_id=str(slot), slot=slot, token_ids=tokens, block_ids=[slot],
                               num_new_tokens=len(tokens),
                               sampling=internal_pb2.SamplingConfig(seed=adapter, has_seed=True))


def test_a_hook_with_a_per_row_column_takes_part_in_every_stage_in_order():
    hook = AdapterColumn()
    step = pipeline([hook])
    result = internal_pb2.StepResult(step_id=0)
    step.run(internal_pb2.StepPlan(step_id=0, new_seqs=[new_seq(0, [1, 2, 3], 40), new_seq(1, [4], 9)]),
             result)
    assert hook.calls == ["drop", "add", "add", "apply_plan", "prepare", "needs_logits", "mask",
                          "after_sample", "settle", "accept"]
    assert hook.seen == [[40, 9]]  # its column, in the step's row order
    # Its mask reached the sampler: each row took its adapter's token, not its greedy one.
    assert (unpack_list(result.slots), unpack_list(result.token_ids)) == ([0, 1], [40, 9])
    assert step.batch.tokens(0).tolist() == [1, 2, 3, 40]
    hook.calls.clear()
    result = internal_pb2.StepResult(step_id=1)
    step.run(internal_pb2.StepPlan(step_id=1, dropped_slots=[0], running_slots=pack([1]),
                                   running_num_tokens=pack([1])), result)
    assert hook.calls == ["drop", "apply_plan", "prepare", "needs_logits", "mask", "after_sample",
                          "settle", "accept"]
    assert unpack_list(result.token_ids) == [9]
    step.forget()
    assert hook.calls[-1] == "forget" and not step.batch.held.any()


def test_only_the_points_a_hook_overrides_are_called_and_a_failed_step_is_undone():
    hook = AdapterColumn()
    step = pipeline([StepHook(), hook], OneHotModel(fail=True))
    assert [h.__self__ for h in step._at["mask"]] == [hook]  # the base hook's no-ops are never called
    with pytest.raises(RuntimeError, match="the forward failed"):
        step.run(internal_pb2.StepPlan(step_id=0, new_seqs=[new_seq(0, [1, 2], 3)]),
                 internal_pb2.StepResult(step_id=0))
    assert hook.calls == ["drop", "add", "apply_plan", "prepare", "undo"]


def test_without_hooks_the_step_samples_greedily():
    result = internal_pb2.StepResult(step_id=0)
    pipeline([]).run(internal_pb2.StepPlan(step_id=0, new_seqs=[new_seq(0, [5, 6, 7], 0)]), result)
    assert unpack_list(result.token_ids) == [7]  # the one-hot model's argmax: the last input token
