"""Sequence groups: what a worker's scheduler admits, schedules, preempts, requeues and ends, each
as a whole. A plain request is a group of one (Single, here); n > 1 sequences sharing a prompt are
Forks (scheduler/forks.py); a beam search is a BeamSearch (scheduler/beam_search.py). The router
makes the group of each request; the scheduler iterates groups and knows none of those kinds. Each
kind keeps its own state and acts on its worker only through the verbs of `Batch` and the queues'.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from proto import internal_pb2 as pb
from proto.speculation import may_speculate
from scheduler.draft_length import DraftLength
from scheduler.request import FinishReason, Request, Status

if TYPE_CHECKING:
    from scheduler.scheduler_config import SchedulerConfig
    from scheduler.kv_cache_manager import KVCacheManager
    from scheduler.preemption import PreemptionPolicy
    from scheduler.queues import Queues
    from scheduler.speculation_stats import SpeculationStats
    from scheduler.step import Step


class Batch(Protocol):
    """What a group may use of its worker's scheduler (scheduler/scheduler.py)."""
    config: SchedulerConfig
    kv: KVCacheManager
    queues: Queues
    preemption: PreemptionPolicy
    speculation: SpeculationStats

    def add_sequence(self, seq: Request) -> None: ...
    def finish(self, seq: Request, reason: FinishReason) -> None: ...
    def recompute(self, seq: Request) -> None: ...
    def drop_slot(self, seq: Request) -> None: ...
    def preempt_for(self, group: SequenceGroup, step: Step) -> bool: ...
    def has_room(self, seats: int, step: Step) -> bool: ...


class SequenceGroup:
    """The interface, with the defaults of a group that streams its sequences' own tokens."""
    __slots__ = ()
    handle: Request          # the request as the router knows it; its status is the group's
    key: tuple[int, int]     # (priority, arrival), the order of every queue
    suspect: bool            # it was in a failed step: it runs alone until a step with it succeeds
    num_seqs = 1             # sequences it holds in the batch while it runs
    grows = False            # it may fork more sequences while it runs (then `reserve` counts)
    reserve = 0
    # The worker's sampled token is not its sequences' next one: the group picks those from the
    # candidates (add_candidates, on_result), and its output is known only at its end
    # (final_deltas). False: each sequence streams the tokens it samples.
    picks_tokens = False

    @property
    def seats(self) -> int:
        """Sequences it needs room for to be admitted now; their blocks, at worst, too."""
        return 1

    def seqs(self) -> list[Request]:
        """Its unfinished sequences on this worker."""
        raise NotImplementedError

    def start(self, sched: Batch) -> None:
        """It arrives on a worker: its sequences, new there, wait."""
        raise NotImplementedError

    def admit(self, sched: Batch, step: Step) -> bool:
        """From waiting, whole into `step` (the caller checked has_room), or not at all: False."""
        raise NotImplementedError

    def resume(self, sched: Batch, step: Step) -> bool:
        """From swapped, into `step`; False: not now."""
        raise NotImplementedError

    def schedule(self, sched: Batch, step: Step) -> None:
        """Its work in `step` while it runs: the next tokens or prefill chunks."""
        raise NotImplementedError

    def preempt(self, sched: Batch, step: Step) -> None:
        """Out of the batch to make room: swapped, or requeued to be computed again."""
        raise NotImplementedError

    def requeue(self, sched: Batch, suspect: bool) -> None:
        """After a failed step: back to waiting with nothing computed and nothing pending, and
        apart as a suspect if it was in the failed step itself."""
        raise NotImplementedError

    def fail(self, sched: Batch, failed: list[Request], alone: bool) -> Request | None:
        """A step with some of its sequences failed (`failed`: those of the failed step, the
        others were in the void plans after it). Returns its handle if it is the cause, for the
        caller to end with INTERNAL; else it is requeued."""
        raise NotImplementedError

    def end(self, sched: Batch, reason: FinishReason) -> None:
        raise NotImplementedError

    def add_candidates(self, seq: Request, logprobs: pb.Logprobs | None) -> bool:
        """picks_tokens: seq's candidates came; False if they no longer matter."""
        raise NotImplementedError

    def on_result(self, sched: Batch) -> bool:
        """picks_tokens, after its candidates of a step came: True when it has ended."""
        raise NotImplementedError

    def final_deltas(self, error: pb.Error | None) -> list[pb.TokenDelta]:
        """picks_tokens: what the gateway gets at its end."""
        raise NotImplementedError

    def drained(self) -> list[Request]:
        """Its worker is gone: the requests to route again, each with the group it forms alone."""
        raise NotImplementedError


@dataclass(eq=False, slots=True)
class Single(SequenceGroup):
    """A plain request: one sequence, the handle itself."""
    handle: Request
    key: tuple[int, int] = field(init=False)

    # Tokens at its prompt's end left for later: none here; Forks' children fork at the last one
    # (_reach_held_back).
    held_back = 0

    def __post_init__(self) -> None:
        self.key = self.handle.sort_key()

    @property
    def suspect(self) -> bool:
        return self.handle.suspect

    @suspect.setter
    def suspect(self, value: bool) -> None:
        self.handle.suspect = value

    def seqs(self) -> list[Request]:
        return [self.handle]

    def start(self, sched: Batch) -> None:
        self.handle.group = self
        sched.add_sequence(self.handle)

    def admit(self, sched: Batch, step: Step) -> bool:
        seq, kv = self.handle, sched.kv
        if seq.num_pending:
            return False  # a result of before its preemption is still on the way
        hits = kv.get_computed_blocks(seq)
        n = min(seq.num_tokens - len(hits) * kv.block_size - self.held_back, step.budget)
        blocks = kv.allocate_slots(seq, n, hits)
        if blocks is None:
            return False
        kv.count_admission(seq)
        sched.queues.admit(self, (seq,))
        self._take(sched, n, blocks, step)
        return True

    def resume(self, sched: Batch, step: Step) -> bool:
        seq = self.handle
        if seq.num_pending:
            return False  # its last token is still on the way
        n = min(seq.num_tokens - seq.num_computed_tokens - self.held_back, step.budget)
        moves = sched.kv.swap_in(seq, n)
        if moves is None:
            return False
        step.swap_in += moves
        sched.queues.admit(self, (seq,))
        self._take(sched, n, [], step)
        return True

    def _take(self, sched: Batch, n: int, blocks: list[int], step: Step) -> None:
        """Its chunk as it (re)joins the batch, or what comes at the tokens it holds back. Only
        the running phase may preempt for that: a sequence admitted in this step must not leave
        again in it."""
        if n > 0:
            step.take(self.handle, n, blocks)
        elif self.held_back:
            self._reach_held_back(sched, step, may_preempt=False)

    def _reach_held_back(self, sched: Batch, step: Step, may_preempt: bool = True) -> None:
        """Its work reached the tokens it holds back (none here)."""

    def schedule(self, sched: Batch, step: Step) -> None:
        seq = self.handle
        if seq.status is not Status.RUNNING or seq.suspect:
            return  # a victim earlier in this step, or a suspect (it runs alone)
        known = len(seq.all_token_ids) + seq.num_pending
        if known >= seq.length_limit:
            return  # its last token is on the way; it ends when that arrives
        todo = known - seq.num_computed_tokens - self.held_back
        if todo <= 0:
            if todo == 0 and self.held_back:
                self._reach_held_back(sched, step)
            return
        n, kv = min(todo, step.budget), sched.kv
        # 0 (off, or the batch too large): no call on the decode path. A fork holding back its
        # last tokens computes short of its end: no token, no proposals.
        k = step.lookahead
        k = _lookahead(k, seq, known, step) if k and not self.held_back else 0
        blocks = kv.allocate_slots(seq, n, num_lookahead_tokens=k) if k else None
        if blocks is None:  # no room for proposals: a plain decode, for which others may go
            k = 0
            blocks = kv.allocate_slots(seq, n)
        # Preempting others (the last in line first) while the blocks run out.
        while blocks is None and sched.preempt_for(self, step):
            blocks = kv.allocate_slots(seq, n)
        if blocks is not None:
            step.take(seq, n, blocks)
            if k:
                step.speculate(seq, k)

    def preempt(self, sched: Batch, step: Step) -> None:
        """Swap out to CPU when the cost model says moving the blocks twice beats computing the
        tokens again; else recompute. Freed blocks keep their hashes, so a recompute often finds
        most of its prefix still cached. A suspect is recomputed: it must run alone anyway."""
        seq = self.handle
        step.preempted = True
        seq.num_preemptions += 1
        if not seq.suspect and sched.preemption.choose(seq) == "swap":
            step.swap_out += sched.kv.swap_out(seq)
            sched.drop_slot(seq)
            sched.queues.mark_swapped(seq)
        else:
            sched.recompute(seq)
            sched.queues.enqueue(self)

    def requeue(self, sched: Batch, suspect: bool) -> None:
        # Tokens the failed or void plans were to sample never come: none is pending any more.
        seq = self.handle
        queued = seq.status is Status.WAITING  # preempted while the plans ran: in line already
        if not queued:
            sched.recompute(seq)
        seq.num_computed_tokens = seq.num_pending = 0
        seq.num_preemptions += 1
        if suspect and not seq.suspect:
            seq.suspect = True
            if queued:  # a suspect waits apart from the heap
                sched.queues.requeue(self)
                return
        if not queued:
            sched.queues.enqueue(self)

    def fail(self, sched: Batch, failed: list[Request], alone: bool) -> Request | None:
        if alone and failed and self.handle.suspect:
            return self.handle  # it failed alone: the cause
        self.requeue(sched, suspect=bool(failed))
        return None

    def end(self, sched: Batch, reason: FinishReason) -> None:
        sched.finish(self.handle, reason)

    def final_deltas(self, error: pb.Error | None) -> list[pb.TokenDelta]:
        return []  # it streamed its tokens, and its last delta, as they came (Router._emit)

    def drained(self) -> list[Request]:
        return [self.handle]


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
