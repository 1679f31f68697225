"""n > 1 sequences of one prompt: sequence 0 computes the prompt, then the others fork its blocks
(copy-on-write) and from there each goes on as a plain sequence of its own (Single).

Until the fork the children wait off the queues, counted as waiting, while the parent is scheduled
as a plain sequence that stops one token short of its prompt's end: the children fork at that last
token, which the parent and each child then compute in the same step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler import progress, single
from scheduler.batch import Batch
from scheduler.request import Request, Status
from scheduler.sequence_group import OneHandle
from scheduler.single import Single

if TYPE_CHECKING:
    from scheduler.step import Step


@dataclass(eq=False, slots=True)
class Forks(OneHandle):
    """handle: sequence 0, the parent, scheduled as a plain sequence (scheduler/single.py) that
    holds back its last prompt token until the fork, then as a plain one."""
    handle: Request
    children: list[Request] = field(default_factory=list)  # until the fork
    key: tuple[int, int] = field(init=False)

    @property
    def seats(self) -> int:
        return 1 + len(self.children)

    @property
    def held_back(self) -> int:
        return 1 if self.children else 0

    def seqs(self) -> list[Request]:
        return [s for s in (self.handle, *self.children) if s.status is not Status.FINISHED]

    def start(self, sched: Batch) -> None:
        self.handle.group = self
        sched.add_sequence(self.handle)
        for child in self.children:  # on the parent's worker, to share its blocks
            child.group, child.worker = self, self.handle.worker
            sched.add_sequence(child)

    def admit(self, sched: Batch, step: Step) -> bool:
        n = single.admit(self, sched, step, self.held_back)
        if n is not None and n <= 0 and self.children:
            self._fork(sched, step, may_preempt=False)  # admitted in this step: none may leave
        return n is not None

    def resume(self, sched: Batch, step: Step) -> bool:
        n = single.resume(self, sched, step, self.held_back)
        if n is not None and n <= 0 and self.children:
            self._fork(sched, step, may_preempt=False)
        return n is not None

    def schedule(self, sched: Batch, step: Step) -> None:
        if single.schedule(self, sched, step, self.held_back):
            self._fork(sched, step)

    def preempt(self, sched: Batch, step: Step) -> None:
        single.preempt(self, sched, step)

    def requeue(self, sched: Batch, suspect: bool) -> None:
        single.requeue(self, sched, suspect)

    def _fork(self, sched: Batch, step: Step, may_preempt: bool = True) -> None:
        """The fork: the parent computes its prompt's last token and its children start from
        there, sharing its blocks; one token each, if the step has room for all of them."""
        parent, kv = self.handle, sched.kv
        children = [c for c in self.children if c.status is not Status.FINISHED]  # not aborted
        if not sched.has_room(len(children), step) or 1 + len(children) > step.budget:
            return  # a later step forks it
        while kv.fork_cost(parent, len(children), 1) > kv.num_free:
            if not may_preempt or not sched.preempt_for(self, step):
                return
        blocks = kv.allocate_slots(parent, 1)
        for child in children:  # from the parent's state before this step's token
            copy = kv.fork(parent, child)
            progress.found(child, parent.num_computed_tokens)
            if copy is not None:
                step.copy.append(copy)
            child.num_cached_tokens = parent.num_cached_tokens
            sched.queues.mark_running(child)
            step.take(child, 1, [])
            child.group = Single(child)
            step.forked.append(child.group)  # it joins the running list at the step's end
        step.take(parent, 1, blocks)
        self.children = []

    def drained(self) -> list[Request]:
        """Each goes on alone: the fork, if it happens again, happens among what is left."""
        out = self.seqs()
        for seq in out:
            seq.group = Single(seq)
        return out
