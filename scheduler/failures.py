"""A step the worker failed, and the plans sent after it.

A failed step's sequences may be what breaks the worker, or its innocent neighbours: each is
recomputed and marked suspect, and a suspect runs alone (Scheduler.schedule) until a step with it
succeeds, which clears it. A suspect that fails alone is the cause: it ends with INTERNAL.

A plan sent after the failed one counted on the failed step's sampled tokens and cache writes, so
it is void: its sequences are recomputed too (not suspect), and its result is dropped when it
comes back. Blocks those steps may have written leave the prefix cache.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from scheduler import beam
from scheduler.request import FinishReason, Request, Status

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


def fail_oldest(sched: "Scheduler") -> list[Request]:
    """The worker failed the oldest plan in flight. Returns the suspects that failed alone, for
    the caller to end with INTERNAL; every other sequence of that plan and of the void plans
    after it is requeued for recompute."""
    step = sched.in_flight.popleft()
    sched.reuse_slots(step.step_id)
    failed = _live(step.entries)
    # A suspect's step holds nothing else, but for the children its fork brings along.
    culprits = [req for req in failed if req.suspect and req.beam is None] if step.alone else []
    for later in sched.in_flight:
        later.void = True
    others = [r for r in _live(e for s in sched.in_flight for e in s.entries) if r not in failed]
    in_flight_tokens: dict[int, int] = {}
    for s in (step, *sched.in_flight):
        for req, n, _ in s.entries:
            in_flight_tokens[id(req)] = in_flight_tokens.get(id(req), 0) + n
    groups = []
    for req in failed + others:
        # The failed and void steps wrote (or not) the positions after this one; a block cached
        # one step early (its last token's KV still in flight) must not be found again.
        first_bad = max(0, req.num_tokens - in_flight_tokens.get(id(req), 0) - 1)
        sched.kv.uncache_from(req, first_bad)
        if req.beam is not None:  # a beam search goes back whole
            req.num_pending = 0
            if req.beam not in groups:
                groups.append(req.beam)
        elif req not in culprits:
            requeue_for_recompute(sched, req, suspect=req in failed)
    for group in groups:
        if step.alone and any(b.suspect for b in group.beams):
            beam.end(sched, group, FinishReason.ERROR)  # it failed alone: the cause
            culprits.append(group.handle)
            continue
        suspect = any(b in failed for b in group.beams)
        if any(b.status is Status.RUNNING for b in group.beams):
            group.beams[0].suspect = suspect  # it waits apart, and runs alone, as one
            beam.requeue(sched, group)
        elif suspect and not group.beams[0].suspect:  # preempted while the plans ran
            group.beams[0].suspect = True
            sched.waiting = [e for e in sched.waiting if e[-1].beam is not group]
            heapq.heapify(sched.waiting)
            sched.enqueue(group.beams[0])
    return culprits


def _live(entries) -> list[Request]:
    seen: dict[int, Request] = {}
    for req, _, _ in entries:
        if req.status is not Status.FINISHED:
            seen.setdefault(id(req), req)
    return list(seen.values())


def requeue_for_recompute(sched: "Scheduler", req: Request, suspect: bool) -> None:
    """Back to waiting with nothing computed, whatever its state: tokens the failed or void plans
    were to sample never come, so none is pending any more."""
    if req.status is Status.RUNNING or req.status is Status.SWAPPED:
        if req.status is Status.SWAPPED:
            sched.swapped.remove(req)
        sched.kv.free(req)
        sched.drop_slot(req)
        req.status = Status.WAITING
        sched.num_waiting += 1
        queued = False
    else:  # preempted for recompute while the plans ran: it is in the waiting queue already
        queued = True
    req.num_computed_tokens = req.num_pending = 0
    req.num_preemptions += 1
    if suspect and not req.suspect:
        req.suspect = True
        if queued:  # a suspect waits apart from the queue (Scheduler.suspects)
            sched.waiting = [e for e in sched.waiting if e[-1] is not req]
            heapq.heapify(sched.waiting)
            queued = False
    if not queued:
        sched.enqueue(req)


def schedule_alone(sched: "Scheduler", step) -> bool:
    """Put the first suspect that fits into `step`, alone. False: none fits now (no blocks or
    no room); the caller plans a step of the others. Every suspect here waits: one runs only in
    its own step, which clears it when it succeeds and requeues or ends it when it fails."""
    bs = sched.config.block_size
    for req in sorted(sched.suspects, key=Request.sort_key):
        if req.beam is not None:  # a beam search's leader: the group runs alone, whole
            if req.status is Status.WAITING and beam.admit(sched, req.beam, step):
                step.alone = True
                return True
            continue
        if req.status is not Status.WAITING or req.num_pending:
            continue
        if len(sched.running) + 1 + len(req.fork_children) > sched.config.max_num_seqs:
            continue
        hits = sched.kv.get_computed_blocks(req)
        n = min(req.num_tokens - len(hits) * bs - bool(req.fork_children), step.budget)
        blocks = sched.kv.allocate_slots(req, n, hits)
        if blocks is None:
            continue
        sched.num_waiting -= 1
        sched.start_running(req)
        sched.take_or_fork(req, n, blocks, step)
        step.alone = True
        return True
    return False
