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

from typing import TYPE_CHECKING, Protocol

from proto import internal_pb2 as pb
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
    def recompute(self, group: SequenceGroup, seqs: list[Request]) -> None: ...
    def swap_out(self, group: SequenceGroup, seq: Request, step: Step) -> None: ...
    def swap_in(self, group: SequenceGroup, seq: Request, n: int, step: Step) -> bool: ...
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
                t.num_computed_tokens = 0
            return None
        taken.append((seq, n, blocks))
        budget -= n
    for seq, _, _ in taken:
        kv.count_admission(seq)
    sched.queues.admit(group, seqs)
    for seq, n, blocks in taken:
        if n > 0:
            step.take(seq, n, blocks)
    return [(seq, n) for seq, n, _ in taken]
