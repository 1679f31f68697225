"""What a feature may do in the worker's step: a StepHook is called at named points of the fixed
pipeline (worker/step/pipeline.py), and one Step carries what the stages have made so far.

A feature that needs something per row (speculation's proposals, a grammar's mask, a beam's
chosen token; next an adapter index or a KV load) is a hook plus, where it must persist between
steps, a column in the persistent batch (worker/step/input_batch.py): never a branch in the pipeline.
Every method does nothing by default; the pipeline calls only those a hook overrides, in the
order the hooks were given. A hook may keep what it made in one step on itself (between its
`prepare` and its `pack`): steps run one at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from proto import internal_pb2
from worker.step.input_batch import InputBatch, StepInputs


@dataclass
class Step:
    """One step as the stages build it, in their order."""
    plan: internal_pb2.StepPlan
    result: internal_pb2.StepResult
    batch: InputBatch
    slots: np.ndarray | None = None      # int64: rows that compute this step, in plan order
    counts: np.ndarray | None = None     # int64: tokens each computes (prepare hooks may grow it)
    inputs: StepInputs | None = None
    hidden: torch.Tensor | None = None
    sampled_slots: np.ndarray | None = None  # int64: rows that sample a token, in plan order
    # Rank 0's sampling, where the step computes the logits (not on the greedy fast path):
    params: list = field(default_factory=list)   # each sampled row's SamplingConfig
    history: list = field(default_factory=list)  # each sampled row's tokens so far
    logits: torch.Tensor | None = None           # raw logits [len(sampled_slots), V]
    extra_logits: dict = field(default_factory=dict)  # hook -> the rows it asked for (logits_rows)
    sampled: torch.Tensor | None = None          # int64 on the device; -1: the row failed
    skip_logprobs: set = field(default_factory=set)  # rows whose logprobs a hook wrote itself
    tokens: np.ndarray | None = None             # int64 on the host: each sampled row's token


class StepHook:
    """A feature's part in the step; override only the points it needs."""

    # ---------------------------------------------------------------- apply the plan

    def drop(self, slots) -> None:
        """The plan's dropped slots (after the batch dropped them)."""

    def add(self, new: internal_pb2.NewSeq, sampling: internal_pb2.SamplingConfig) -> None:
        """A sequence enters the batch (called after the batch added it)."""

    def apply_plan(self, step: Step) -> None:
        """The plan's columns for this hook, after the batch took the new blocks."""

    def forget(self) -> None:
        """Every sequence is dropped (a new scheduler knows none of them)."""

    # ---------------------------------------------------------------- prepare inputs

    def prepare(self, step: Step) -> None:
        """Before the inputs are gathered from the batch; may grow step.counts in place."""

    def undo(self, step: Step) -> None:
        """The step failed after prepare: leave the batch as it was before it."""

    # ---------------------------------------------------------------- sample (rank 0)

    def needs_logits(self, step: Step) -> bool:
        """Whether this step must compute the logits (False lets greedy rows take the max of the
        LM head in one pass). Every hook is asked, each step that samples."""
        return False

    def logits_rows(self, step: Step) -> torch.Tensor | None:
        """Rows of the hidden states whose logits this hook needs besides the sampled rows', in
        the same pass over the LM head; they come back in step.extra_logits[self]."""
        return None

    def mask(self, step: Step) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bitmask): the tokens those sampled rows may take next (worker/grammar/matchers.py)."""
        return None

    def after_sample(self, step: Step) -> None:
        """step.sampled is drawn: rewrite rows (-1 fails one), record what was drawn."""

    # ---------------------------------------------------------------- share (tensor parallelism)

    def shared(self, step: Step) -> list[int]:
        """Rank 0: values the other ranks need to advance their batches as rank 0 does; they go
        with the sampled tokens."""
        return []

    def num_shared(self, step: Step) -> int:
        """Another rank: how many values shared() sends this step."""
        return 0

    def take_shared(self, step: Step, values: list[int]) -> None:
        """Another rank: what rank 0's shared() sent."""

    # ---------------------------------------------------------------- advance and pack

    def settle(self, step: Step) -> None:
        """After the batch advanced by the step's counts, before the tokens are appended."""

    def appended(self, step: Step) -> np.ndarray | None:
        """Which sampled rows the worker appends its token to (bool per row), or None: all."""
        return None

    def accept(self, step: Step) -> None:
        """After the tokens are appended (step.sampled_slots and step.tokens, failed rows out)."""

    def pack(self, step: Step) -> bool:
        """Writes the result's token columns itself; True if it did (the first such hook wins)."""
        return False
