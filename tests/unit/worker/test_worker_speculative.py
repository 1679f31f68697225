"""The worker's side of speculative decoding (worker/speculation/speculator.py) on its persistent batch,
without a model: proposals go after the known tokens and grow the row's query; after the step,
the accepted ones stay as computed tokens and the rest are forgotten; a failed step leaves the
batch as it was; a plan that speculates where it may not is refused, naming the slot."""
from __future__ import annotations

import numpy as np
import pytest

from proto import internal_pb2 as pb
from proto.columns import pack, unpack_list
from worker.step.input_batch import InputBatch
from worker.speculation.speculator import Proposals, Speculator, result_columns
from worker.speculation.config import SpeculativeConfig

QUOTED = [5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 5, 6, 7]  # ends with 5 6 7: 8 9 10 11 followed it


def batch_with(*rows: tuple[list[int], pb.SamplingConfig]) -> InputBatch:
    batch = InputBatch(max_model_len=64, block_size=4)
    for slot, (tokens, sampling) in enumerate(rows):
        batch.add(slot, tokens, list(range(16)), num_computed=len(tokens) - 1,
                  num_prompt=len(tokens) - 2, sampling=sampling)
    return batch


def speculator(k: int = 4) -> Speculator:
    return Speculator(SpeculativeConfig.parse(f'{{"method": "ngram", "num_speculative_tokens": {k}}}'))


def test_proposals_follow_the_known_tokens_and_settle_to_the_accepted_ones():
    batch = batch_with((QUOTED, pb.SamplingConfig()), ([3, 4, 3, 9], pb.SamplingConfig()))
    slots, counts = np.array([0, 1]), np.array([1, 1])
    spec = speculator().propose(batch, pack([0, 1]), pack([4, 2]), slots, counts)
    n = len(QUOTED)
    assert spec.rows == [0] and spec.known == [n]  # row 1's last tokens never occurred before
    assert spec.drafts[0].tolist() == [8, 9, 10, 11]
    assert counts.tolist() == [5, 1] and batch.num_tokens[0] == n + 4
    assert batch.tokens(0).tolist() == QUOTED + [8, 9, 10, 11]
    batch.advance(slots, counts)  # the forward computed all five positions
    spec.accepted = [2]
    speculator().settle(batch, slots, spec)
    assert batch.num_tokens[0] == n + 2 and batch.num_computed[0] == n + 2
    assert batch.tokens(0).tolist() == QUOTED + [8, 9]  # the target's token is appended next


def test_method_suffix_sizes_each_draft_by_its_match():
    """QUOTED's last three tokens matched: three proposals at factor 1, however many the plan
    offers; row 1's last token (9) never occurred before: none. The hello tells the scheduler
    that this worker paces its drafts."""
    batch = batch_with((QUOTED, pb.SamplingConfig()), ([3, 4, 3, 9], pb.SamplingConfig()))
    slots, counts = np.array([0, 1]), np.array([1, 1])
    suffix = Speculator(SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 8}'))
    spec = suffix.propose(batch, pack([0, 1]), pack([8, 8]), slots, counts)
    assert spec.rows == [0] and [d.tolist() for d in spec.drafts] == [[8, 9, 10]]
    assert counts.tolist() == [4, 1]
    assert suffix.hello_fields()["speculative_paced_by_worker"]
    assert not speculator().hello_fields()["speculative_paced_by_worker"]


def test_a_failed_step_leaves_the_rows_as_they_were():
    batch = batch_with((QUOTED, pb.SamplingConfig()))
    slots, counts = np.array([0]), np.array([1])
    spec = speculator().propose(batch, pack([0]), pack([3]), slots, counts)
    speculator().undo(batch, slots, spec)
    assert batch.tokens(0).tolist() == QUOTED and batch.num_computed[0] == len(QUOTED) - 1


@pytest.mark.parametrize("sampling,k,counts,why", [
    (pb.SamplingConfig(beam_candidates=2), 2, [1], "one token a step"),
    (pb.SamplingConfig(), 5, [1], r"outside \[1, 4\]"),
    (pb.SamplingConfig(), 2, [3], "not a decode"),
])
def test_a_plan_that_speculates_where_it_may_not_is_refused(sampling, k, counts, why):
    batch = batch_with((QUOTED, sampling))
    with pytest.raises(ValueError, match=why):
        speculator().propose(batch, pack([0]), pack([k]), np.array([0]), np.array(counts))


def test_result_columns_give_each_row_its_run_and_proposal_count():
    spec = Proposals(rows=[1], drafts=[np.array([4, 5, 6])], known=[10], accepted=[2])
    result = pb.StepResult()
    result_columns(result, np.array([3, 7]), np.array([9, 6]), np.array([3, 7]), spec, [[4, 5, 6]])
    assert unpack_list(result.token_ids) == [9, 4, 5, 6]
    assert unpack_list(result.num_tokens) == [1, 3] and unpack_list(result.num_drafts) == [0, 3]
