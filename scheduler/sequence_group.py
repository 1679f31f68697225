"""Sequence groups: what a worker's scheduler admits, schedules, preempts, requeues and ends, each
as a whole. A plain request is a group of one (Single, scheduler/single.py); n > 1 sequences
sharing a prompt are Forks (scheduler/forks.py); a beam search is a BeamSearch
(scheduler/beam_search.py). The router
makes the group of each request; the scheduler iterates groups and knows none of those kinds. Each
kind keeps its own state and acts on its worker only through the verbs of `Batch` and the queues',
each a whole transition (admit_whole, recompute, swap_out, swap_in, finish), so that no kind
sequences the steps of one or writes a status.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from proto import internal_pb2 as pb
from scheduler import progress
from scheduler.batch import Batch
from scheduler.request import FinishReason, Request
from scheduler.results import accept

if TYPE_CHECKING:
    from scheduler.step import Step
    from scheduler.stream import Streams


class SequenceGroup:
    """The interface, with the defaults of a group that streams its sequences' own tokens."""
    __slots__ = ()
    handle: Request          # the request as the router knows it; its status is the group's
    key: tuple[int, int]     # (priority, arrival), the order of every queue
    suspect: bool            # it was in a failed step: it runs alone until a step with it succeeds
    num_seqs = 1             # sequences it holds in the batch while it runs
    grows = False            # it may fork more sequences while it runs (then `reserve` counts)
    reserve = 0

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

    # -- results: the defaults of a group whose sequences stream the tokens they sample --------
    def on_logprobs(self, sched: Batch, seq: Request, logprobs: pb.SlotLogprobs) -> None:
        """Logprobs the worker computed for seq in a step."""
        sched.streams.logprobs(seq.stream, logprobs)

    # on_sampled(sched, seq, tokens) -> bool: seq's row of a step, the tokens it sampled (a
    # speculating row: its accepted run). True: call settle() once the step's rows are all in.
    # A plain sequence accepts them (a function, not a method over it: this runs for every
    # sequence every step).
    on_sampled = staticmethod(accept)

    def settle(self, sched: Batch) -> bool:
        """After the step's rows: True when the group ended."""
        return False

    def report_end(self, streams: Streams, seq: Request, error: pb.Error | None) -> None:
        """seq ended (it or the request: an abort, an error, no worker left): what its gateway
        gets."""
        streams.end(seq.stream, seq, int(seq.finish_reason or FinishReason.ABORT), error)

    def drained(self) -> list[Request]:
        """Its worker is gone: the requests to route again, each with the group it forms alone."""
        raise NotImplementedError


class OneHandle(SequenceGroup):
    """A group whose handle is a sequence of its own (a plain request, the parent of forks): its
    place in the queues and its suspicion are the handle's."""
    __slots__ = ()

    def __post_init__(self) -> None:
        self.key = self.handle.sort_key()

    @property
    def suspect(self) -> bool:
        return self.handle.suspect

    @suspect.setter
    def suspect(self, value: bool) -> None:
        self.handle.suspect = value

    def fail(self, sched: Batch, failed: list[Request], alone: bool) -> Request | None:
        if alone and failed and self.handle.suspect:
            return self.handle  # it failed alone: the cause
        self.requeue(sched, suspect=bool(failed))
        return None

    def end(self, sched: Batch, reason: FinishReason) -> None:
        sched.finish(self.handle, reason)


def admit_whole(sched: Batch, group: SequenceGroup, seqs: list[Request], step: Step,
                held_back: int = 0) -> list[tuple[Request, int]] | None:
    """The one admission of every kind: each of `seqs` from waiting into `step` with its
    prefix-cache hits, all or none (a failure frees what the others took). Returns each with the
    tokens it computes now (0: its hits reach the `held_back` tokens at its end), or None."""
    if any(seq.num_pending for seq in seqs):
        return None  # a result of before its preemption is still on the way
    kv, budget, taken = sched.kv, step.budget, []
    for seq in seqs:
        hits = kv.get_computed_blocks(seq)
        n = min(seq.num_tokens - len(hits) * kv.block_size - held_back, budget)
        blocks = kv.allocate_slots(seq, n, hits)
        if blocks is None:
            for t, _, _ in taken:
                kv.free(t)
                progress.restart(t)
            return None
        progress.found(seq, len(hits) * kv.block_size)
        taken.append((seq, n, blocks))
        budget -= n
    for seq, _, _ in taken:
        kv.count_admission(seq)
    sched.queues.admit(group, seqs)
    for seq, n, blocks in taken:
        if n > 0:
            step.take(seq, n, blocks)
    return [(seq, n) for seq, n, _ in taken]
