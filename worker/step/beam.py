"""Beam search's part in the step: a beam's next token is the scheduler's choice among the
candidates it was sent (SamplingConfig.beam_candidates, with the sampled token's logprobs), so
the worker appends the token a later plan names (StepPlan.next_token_ids), never its own."""
from __future__ import annotations

import numpy as np

from proto.columns import unpack
from worker.step.hook import Step, StepHook


class BeamHook(StepHook):
    def apply_plan(self, step: Step) -> None:
        slots = unpack(step.plan.next_token_slots).astype(np.int64)
        step.batch.check_held(slots)
        step.batch.append_tokens(slots, unpack(step.plan.next_token_ids))

    def appended(self, step: Step) -> np.ndarray | None:
        beam = step.batch.beam[step.sampled_slots]
        return ~beam if beam.any() else None
