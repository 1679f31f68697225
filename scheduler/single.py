"""A plain request, a group of one sequence (Single), and the steps of one plain sequence that
Forks (scheduler/forks.py) composes for its parent: admission, resumption, scheduling,
preemption and requeueing, each told how many tokens at the prompt's end to hold back (a fork's
parent stops one short, and its children fork there) and returning whether the work reached
them, so that no hook for forks sits here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from proto.speculation import may_speculate
from scheduler.draft_length import DraftLength
from scheduler.batch import Batch
from scheduler.request import Request, Status
from scheduler.sequence_group import OneHandle, SequenceGroup, admit_whole

if TYPE_CHECKING:
    from scheduler.step import Step

RUNNING = Status.RUNNING  # read once: an Enum member through its class costs more than a call


# -- one plain sequence: the group's handle ---------------------------------------------------
def admit(group: SequenceGroup, sched: Batch, step: Step, held_back: int = 0) -> int | None:
    """From waiting into `step`: the tokens it computes now (0: it reached those held back), or
    None: not now."""
    taken = admit_whole(sched, group, [group.handle], step, held_back)
    return None if taken is None else taken[0][1]


def resume(group: SequenceGroup, sched: Batch, step: Step, held_back: int = 0) -> int | None:
    """From swapped into `step`, as admit()."""
    seq = group.handle
    if seq.num_pending:
        return None  # its last token is still on the way
    n = min(seq.num_tokens - seq.num_computed_tokens - held_back, step.budget)
    if not sched.swap_in(group, seq, n, step):
        return None
    if n > 0:
        step.take(seq, n, [])
    return n


def schedule(group: SequenceGroup, sched: Batch, step: Step, held_back: int = 0) -> bool:
    """Its work in `step` while it runs. Returns True when its work reached the tokens it holds
    back (for the caller to do what comes there)."""
    seq = group.handle
    if seq.status is not RUNNING or seq.suspect:
        return False  # a victim earlier in this step, or a suspect (it runs alone)
    known = len(seq.all_token_ids) + seq.num_pending
    if known >= seq.length_limit:
        return False  # its last token is on the way; it ends when that arrives
    todo = known - seq.num_computed_tokens - held_back
    if todo <= 0:
        return todo == 0 and held_back > 0
    n, kv = min(todo, step.budget), sched.kv
    # 0 (off, or the batch too large): no call on the decode path. A fork holding back its
    # last tokens computes short of its end: no token, no proposals.
    k = step.lookahead
    k = _lookahead(k, seq, known, step) if k and not held_back else 0
    blocks = kv.allocate_slots(seq, n, num_lookahead_tokens=k) if k else None
    if blocks is None:  # no room for proposals: a plain decode, for which others may go
        k = 0
        blocks = kv.allocate_slots(seq, n)
    # Preempting others (the last in line first) while the blocks run out.
    while blocks is None and sched.preempt_for(group, step):
        blocks = kv.allocate_slots(seq, n)
    if blocks is not None:
        step.take(seq, n, blocks)
        if k:
            step.speculate(seq, k)
    return False


def preempt(group: SequenceGroup, sched: Batch, step: Step) -> None:
    """Swap out to CPU when the cost model says moving the blocks twice beats computing the
    tokens again; else recompute. Freed blocks keep their hashes, so a recompute often finds
    most of its prefix still cached. A suspect is recomputed: it must run alone anyway."""
    seq = group.handle
    step.preempted = True
    seq.num_preemptions += 1
    if not seq.suspect and sched.preemption.choose(seq) == "swap":
        sched.swap_out(group, seq, step)
    else:
        sched.recompute(group, [seq])


def requeue(group: SequenceGroup, sched: Batch, suspect: bool) -> None:
    """After a failed step (whose caller resets its progress: Scheduler.fail_oldest)."""
    seq = group.handle
    queued = seq.status is Status.WAITING  # preempted while the plans ran: in line already
    newly_suspect = suspect and not seq.suspect
    seq.suspect = seq.suspect or suspect
    if not queued:
        sched.recompute(group, [seq])  # a suspect waits apart from the heap
    elif newly_suspect:
        sched.queues.requeue(group)
    seq.num_preemptions += 1


def _lookahead(k: int, seq: Request, known: int, step: Step) -> int:
    """Proposals a running sequence may verify this step: only a decode (one token to compute,
    none on the way) whose sampling allows it, no more than its length limit and the step's
    budget leave room for, and no more than its own draft length (which backs off when its
    proposals fail) unless the worker sizes each draft itself (method suffix)."""
    if known - seq.num_computed_tokens != 1 or not seq.on_worker or not may_speculate(seq.sampling):
        return 0
    room = min(k, seq.length_limit - known - 1, step.budget - 1)
    if step.paced_by_worker:
        return 0 if seq.num_pending else max(0, room)
    if seq.draft is None:
        seq.draft = DraftLength(k)
    if seq.num_pending:  # a plan ahead: its last token is not known yet
        seq.draft.tick()
        return 0
    # k caps its draft length too: a sequence recomputed on another worker (one that lost its
    # worker) carries the draft length it learned where k may have been larger.
    return max(0, min(seq.draft.next(), room))


@dataclass(eq=False, slots=True)
class Single(OneHandle):
    """A plain request: one sequence, the handle itself."""
    handle: Request
    key: tuple[int, int] = field(init=False)

    def seqs(self) -> list[Request]:
        return [self.handle]

    def start(self, sched: Batch) -> None:
        self.handle.group = self
        sched.add_sequence(self.handle)

    def admit(self, sched: Batch, step: Step) -> bool:
        return admit(self, sched, step) is not None

    def resume(self, sched: Batch, step: Step) -> bool:
        return resume(self, sched, step) is not None

    # The plain sequence's steps themselves, not methods over them: schedule runs for every
    # sequence every step.
    schedule = schedule
    preempt = preempt
    requeue = requeue

    def drained(self) -> list[Request]:
        return [self.handle]
