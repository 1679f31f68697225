"""Speculative decoding's part in the step (worker/speculation/speculator.py does the work): propose before
the inputs are gathered, ask for the proposals' logits, verify after sampling, share the
accepted counts with the other ranks, settle the batch, and pack each row's run of tokens.

Every worker has this hook: without --speculative-config it refuses a plan that speculates."""
from __future__ import annotations

import torch

from worker.grammar.matchers import GrammarRows
from worker.step.sampler import Sampler
from worker.speculation.speculator import Proposals, Speculator, result_columns
from worker.step.hook import Step, StepHook


class SpeculationHook(StepHook):
    def __init__(self, speculator: Speculator | None, grammar: GrammarRows, sampler: Sampler) -> None:
        self.speculator = speculator
        self.grammar = grammar   # a constrained row's proposals are masked by its grammar
        self.sampler = sampler   # its generator draws the unseeded rows' verification
        self.spec: Proposals | None = None     # this step's proposals
        self.runs: list[list[int]] | None = None  # this step's runs of tokens (rank 0)

    def prepare(self, step: Step) -> None:
        self.spec = self.runs = None
        plan = step.plan
        if not plan.spec_slots:
            return
        if self.speculator is None:
            raise ValueError("a plan speculates on a worker started without --speculative-config")
        self.spec = self.speculator.propose(step.batch, plan.spec_slots, plan.spec_num_tokens,
                                            step.slots, step.counts)

    def undo(self, step: Step) -> None:
        if self.spec:
            self.speculator.undo(step.batch, step.slots, self.spec)

    def _speculated(self) -> bool:
        return self.spec is not None and bool(self.spec.rows)

    def needs_logits(self, step: Step) -> bool:
        return self._speculated()

    def logits_rows(self, step: Step) -> torch.Tensor | None:
        # the proposals' positions, in the same pass over the LM head as the sampled rows
        return self.speculator.draft_logits_indices(self.spec, step.counts) if self._speculated() else None

    def after_sample(self, step: Step) -> None:
        if not self._speculated():
            return
        self.runs, skip = self.speculator.verify_rows(
            self.spec, step.batch, self.grammar, step.slots, step.sampled_slots, step.params,
            step.history, step.extra_logits[self], step.logits, step.sampled,
            self.sampler.generator, step.result)
        step.skip_logprobs |= skip

    def shared(self, step: Step) -> list[int]:
        return self.spec.accepted if self.spec else []

    def num_shared(self, step: Step) -> int:
        return len(self.spec.rows) if self.spec else 0

    def take_shared(self, step: Step, values: list[int]) -> None:
        if self.spec:
            self.spec.accepted = values

    def settle(self, step: Step) -> None:
        if self.spec:
            self.speculator.settle(step.batch, step.slots, self.spec)

    def pack(self, step: Step) -> bool:
        if self.runs is None or not self.spec.rows:  # runs: rank 0 verified this step's rows
            return False
        result_columns(step.result, step.sampled_slots, step.tokens, step.slots, self.spec, self.runs)
        return True
