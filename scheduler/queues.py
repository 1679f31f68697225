"""One worker's queues: which sequence groups wait, run, are swapped out, wait apart as suspects or
are not ready yet, and how many sequences wait. Every move between them is a verb here, and so is
every change of the status of a sequence in them, so that the counts and the heap stay true;
nothing else touches these containers. Each verb is a whole transition (a group is admitted,
swapped out, recomputed or ends), and moves the status of the group's handle with it: a beam
search's handle is none of its sequences (scheduler/beam_search.py). A request no worker holds (a
pending, drained or refused one) has its status set by the router and the scheduler's drain.

Entries are sequence groups (scheduler/sequence_group.py). A group that leaves a queue by ending
(or by being admitted through the suspects) is dropped from it lazily: prune() at each step's start,
next_waiting() for the heap.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from typing import Protocol

from scheduler.request import Request, Status


class Queued(Protocol):
    """What the queues read of a group (SequenceGroup provides it)."""
    handle: Request      # its status is the group's
    key: tuple[int, int]  # (priority, arrival): lower runs first
    num_seqs: int         # sequences it holds in the batch while it runs
    grows: bool           # it may fork more sequences while running (reserve)
    reserve: int          # how many more it may still fork into now
    suspect: bool


def _key(group: Queued) -> tuple[int, int]:
    return group.key


class Queues:
    def __init__(self) -> None:
        self.waiting: list[tuple[int, int, int, Queued]] = []  # heap: priority, arrival, tiebreak
        self._tiebreak = itertools.count()
        self.running: list[Queued] = []      # in priority order
        self.swapped: list[Queued] = []      # in priority order
        # Waiting groups of a failed step, kept off the heap: each runs alone until a step with
        # it succeeds (Scheduler.fail_oldest).
        self.suspects: list[Queued] = []
        # Waiting groups that may not be admitted yet (structured outputs will wait here for a
        # compiled grammar), by their handle's seq_id, until mark_ready.
        self.not_ready: dict[str, Queued] = {}
        self.requests: dict[str, Request] = {}  # every unfinished sequence, by seq_id
        self.groups: dict[str, Queued] = {}     # every group added, by its handle's seq_id
        self.num_waiting = 0  # sequences in status WAITING (not ready and fork children included)
        # Sequences of the running groups as of the step's start (prune), plus those started
        # since: a victim of this step still counts until the next.
        self.num_running = 0
        self.growing: list[Queued] = []  # running groups that may fork more (reserved())

    # -- sequences ----------------------------------------------------------------------------
    def add(self, seq: Request, running: bool = False) -> None:
        """A new sequence of this worker: it waits, or (a beam forked in the batch) runs."""
        seq.status = Status.RUNNING if running else Status.WAITING
        self.num_waiting += not running
        self.requests[seq.seq_id] = seq

    def mark_running(self, seq: Request) -> None:
        """A waiting or swapped sequence runs (its group joins the running list apart)."""
        if seq.status is Status.WAITING:
            self.num_waiting -= 1
        elif seq.status is Status.SWAPPED:
            self.swapped.remove(seq.group)
        seq.status = Status.RUNNING

    def _mark_waiting(self, seq: Request) -> None:
        if seq.status is Status.SWAPPED:
            self.swapped.remove(seq.group)
        if seq.status is not Status.WAITING:
            seq.status = Status.WAITING
            self.num_waiting += 1

    def remove(self, seq: Request) -> None:
        """The sequence ended: it leaves every count and list, and its group too if seq was
        what the router knows the group by."""
        if seq.status is Status.WAITING:
            self.num_waiting -= 1
        elif seq.status is Status.SWAPPED:
            self.swapped.remove(seq.group)
        seq.status = Status.FINISHED
        self.requests.pop(seq.seq_id, None)
        if seq.group is not None and self.groups.get(seq.seq_id) is seq.group:
            self.forget(seq.group)

    # -- groups -------------------------------------------------------------------------------
    def track(self, group: Queued) -> None:
        """A group arrives (its sequences were added): it waits, and is known by its handle."""
        group.handle.status = Status.WAITING  # a beam search's handle is none of its sequences
        self.groups[group.handle.seq_id] = group

    def end(self, group: Queued) -> None:
        """A group whose sequences all ended (remove) ends too."""
        group.handle.status = Status.FINISHED
        self.forget(group)

    def forget(self, group: Queued) -> None:
        """The group ended: it is known by its handle no longer."""
        self.groups.pop(group.handle.seq_id, None)
        self.not_ready.pop(group.handle.seq_id, None)

    def enqueue(self, group: Queued, ready: bool = True) -> None:
        """A waiting group joins the heap, or the suspects, or (not ready) waits apart."""
        if not ready:
            self.not_ready[group.handle.seq_id] = group
        elif group.suspect:
            self.suspects.append(group)
        else:
            priority, arrival = group.key
            heapq.heappush(self.waiting, (priority, arrival, next(self._tiebreak), group))

    def mark_ready(self, group: Queued) -> None:
        """A group that was not ready may be admitted from now on."""
        if self.not_ready.pop(group.handle.seq_id, None) is group and \
                group.handle.status is Status.WAITING:
            self.enqueue(group)

    def requeue(self, group: Queued) -> None:
        """A group waiting in the heap goes where its state says now (it became a suspect)."""
        self.waiting = [e for e in self.waiting if e[-1] is not group]
        heapq.heapify(self.waiting)
        self.enqueue(group)

    def next_waiting(self) -> Queued | None:
        """The first group in line, after dropping those that left it (they ended, ran, or now
        wait as suspects)."""
        waiting = self.waiting
        while waiting:
            group = waiting[0][-1]
            if group.handle.status is Status.WAITING and not group.suspect:
                return group
            heapq.heappop(waiting)
        return None

    def pop_waiting(self) -> None:
        """The first group in line was admitted."""
        heapq.heappop(self.waiting)

    def admit(self, group: Queued, seqs) -> None:
        """A waiting or swapped group joins the batch, with those of its sequences that run now."""
        for seq in seqs:
            self.mark_running(seq)
        group.handle.status = Status.RUNNING
        self.start_running(group)

    def recompute(self, group: Queued, seqs) -> None:
        """A group leaves the batch to be computed again: `seqs`, its sequences, wait, and it
        waits in line (or apart: a suspect)."""
        for seq in seqs:
            self._mark_waiting(seq)
        group.handle.status = Status.WAITING
        self.enqueue(group)

    def swap_out(self, group: Queued, seq: Request) -> None:
        """A running sequence's blocks went to CPU: its group waits in the swapped list."""
        seq.status = group.handle.status = Status.SWAPPED
        bisect.insort(self.swapped, group, key=_key)  # after its equals: first out, first in

    def start_running(self, *groups: Queued) -> None:
        """Groups whose sequences run now join the running list."""
        for group in groups:
            self.running.append(group)
            self.num_running += group.num_seqs
            if group.grows:
                self.growing.append(group)
        self.running.sort(key=_key)

    def reserved(self) -> int:
        """Sequences the running groups may still fork into: room kept for them in the batch."""
        return sum(g.reserve for g in self.growing) if self.growing else 0

    def prune(self) -> None:
        """At a step's start: the running lists keep the groups that run, the suspects those
        still suspect and unfinished."""
        running, num_running, RUNNING = [], 0, Status.RUNNING
        for group in self.running:
            if group.handle.status is RUNNING:
                running.append(group)
                num_running += group.num_seqs
        self.running, self.num_running = running, num_running
        if self.growing:
            self.growing = [g for g in self.growing if g.handle.status is RUNNING]
        if self.suspects:
            self.suspects = [g for g in self.suspects
                             if g.suspect and g.handle.status is not Status.FINISHED]

    def clear(self) -> None:
        self.__init__()
