"""Structured outputs' part in the step (worker/grammar/matchers.py holds the matchers): a sequence's
matcher follows it into and out of the batch, its mask goes to the sampler, a row its grammar
leaves no token fails, and the sampled tokens advance the matchers. Rank 0 alone has this hook:
it alone samples."""
from __future__ import annotations

import torch

from proto import internal_pb2
from worker.grammar.matchers import GrammarRows, why_no_token
from worker.step.hook import Step, StepHook


class GrammarHook(StepHook):
    def __init__(self, grammar: GrammarRows) -> None:
        self.grammar = grammar
        self.rows: list[int] = []  # this step's constrained rows (indices into the sampled rows)

    def drop(self, slots) -> None:
        self.grammar.drop(slots)

    def add(self, new: internal_pb2.NewSeq, sampling: internal_pb2.SamplingConfig) -> None:
        self.grammar.add(new.slot, sampling, new.token_ids[new.num_prompt_tokens:])

    def forget(self) -> None:
        self.grammar.drop(list(self.grammar.matchers) + list(self.grammar.failed))

    def needs_logits(self, step: Step) -> bool:
        self.rows = self.grammar.constrained(step.sampled_slots.tolist())
        return bool(self.rows or self.grammar.failed)

    def mask(self, step: Step) -> tuple[list[int], torch.Tensor] | None:
        if not self.rows:
            return None
        return self.rows, self.grammar.mask(step.sampled_slots.tolist(), self.rows, step.logits.shape[1])

    def after_sample(self, step: Step) -> None:
        """Rows whose grammar left them no token (only constrained rows can be), or that have no
        matcher to go on with, end (result.failed) instead of sampling: their token becomes -1.
        A batch without grammars pays nothing here."""
        failed, rows, sampled = self.grammar.failed, self.rows, step.sampled
        if not rows and not failed:
            return
        slots = step.sampled_slots.tolist()
        dead = torch.nonzero(sampled < 0).flatten().tolist() if rows else []
        stuck = [i for i, s in enumerate(slots) if s in failed] if failed else []
        for i in sorted({*dead, *stuck}):
            slot = slots[i]
            why = failed.get(slot) or why_no_token(
                step.params[i], len(step.history[i]) - int(step.batch.num_prompt[slot]))
            sampled[i] = -1
            step.result.failed.append(internal_pb2.SeqFailure(slot=slot, reason=why))

    def accept(self, step: Step) -> None:
        self.grammar.accept(step.sampled_slots, step.tokens)
