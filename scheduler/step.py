"""One step of one worker, while it is planned and while it runs: a local object that schedule()
fills and returns into the plan, then keeps until the worker's result for it comes back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from proto import internal_pb2 as pb
from proto.columns import pack
from scheduler.progress import take

if TYPE_CHECKING:
    from scheduler.request import Request


@dataclass
class Step:
    step_id: int
    budget: int                     # tokens still free in this step
    lookahead: int = 0              # proposals a decode may verify (0: none this step)
    paced_by_worker: bool = False   # its proposer sizes each draft: every decode is offered k
    # (sequence, tokens to compute): new to the worker (sent whole), or held by it (by slot).
    new: list[tuple["Request", int]] = field(default_factory=list)
    held: list[tuple["Request", int]] = field(default_factory=list)
    new_block_slots: list[int] = field(default_factory=list)  # a held sequence grew: whose,
    new_block_ids: list[int] = field(default_factory=list)    # and which block
    # Block moves, (src, dst) as the KV manager returns them: protobuf only in plan().
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy: list[tuple[int, int]] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    next_token_slots: list[int] = field(default_factory=list)  # beam search: a held sequence's
    next_token_ids: list[int] = field(default_factory=list)    # next token, chosen by the scheduler
    spec_slots: list[int] = field(default_factory=list)        # held decodes that may propose
    spec_num_tokens: list[int] = field(default_factory=list)   # up to this many tokens each
    preempted: bool = False
    forked: list = field(default_factory=list)  # groups forked into the batch, to join its running list
    alone: bool = False             # a suspect's step: nothing else runs in it
    void: bool = False              # sent before a failed step came back: its result is dropped
    sent_at: float = 0.0            # monotonic; its deadline runs from here or the last result
    # Set by plan(): the step's sequences in plan order, (sequence, tokens, slot).
    entries: list[tuple["Request", int, int]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.new) + len(self.held)

    def take(self, req: "Request", n: int, blocks: list[int]) -> None:
        """req computes n tokens this step, with `blocks` newly added to its table. Its computed
        count moves now, before the step runs, so the next plan can follow this one; a step that
        reaches the end of its known tokens samples one, which the worker feeds back itself."""
        self.budget -= n
        take(req, n)
        if req.on_worker:
            self.held.append((req, n))
            if blocks:
                self.new_block_slots += [req.slot] * len(blocks)
                self.new_block_ids += blocks
        else:
            self.new.append((req, n))

    def speculate(self, req: "Request", k: int) -> None:
        """req, taken for one decode token, may verify up to k proposals too: they come out of
        the budget, and its blocks (allocated with k lookahead slots) hold them."""
        self.budget -= k
        self.spec_slots.append(req.slot)
        self.spec_num_tokens.append(k)

    def is_empty(self) -> bool:
        # Block moves alone make a step: a group may swap in and compute only in a later step
        # (a fork that waits for room), and its blocks must still be moved in this one.
        return not (self.new or self.held or self.dropped or self.swap_out or self.swap_in
                    or self.copy or self.next_token_slots)

    def plan(self) -> pb.StepPlan:
        """The StepPlan of this step; new sequences must have their slots by now."""
        self.entries = [(req, n, req.slot) for req, n in self.new] + \
                       [(req, n, req.slot) for req, n in self.held]
        return pb.StepPlan(
            step_id=self.step_id, dropped_slots=self.dropped, swap_out=_moves(self.swap_out),
            swap_in=_moves(self.swap_in), copy=_moves(self.copy),
            new_seqs=[pb.NewSeq(
                seq_id=req.seq_id, slot=req.slot, token_ids=req.all_token_ids,
                sampling=req.worker_sampling(), num_computed_tokens=req.num_computed_tokens - n,
                block_ids=req.block_ids, num_new_tokens=n, num_prompt_tokens=req.num_prompt_tokens)
                for req, n in self.new],
            running_slots=pack([req.slot for req, _ in self.held]),
            running_num_tokens=pack([n for _, n in self.held]),
            new_block_slots=pack(self.new_block_slots), new_block_ids=pack(self.new_block_ids),
            next_token_slots=pack(self.next_token_slots), next_token_ids=pack(self.next_token_ids),
            spec_slots=pack(self.spec_slots), spec_num_tokens=pack(self.spec_num_tokens))


def _moves(pairs: list[tuple[int, int]]) -> list[pb.BlockCopy]:
    return [pb.BlockCopy(src=src, dst=dst) for src, dst in pairs]
