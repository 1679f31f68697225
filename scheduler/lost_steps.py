"""Sequences whose step was running when its worker died or hung (--max-step-failures).

A lost worker's sequences are recomputed on the others (Router.remove), which is right when the
worker failed on its own. A sequence that itself kills the worker that runs it (say, a kernel
fault on its input) would otherwise kill every worker in turn, forever. So each sequence counts
the lost steps that ran it. The count starts again once it gets further than it had got at its
last loss: a token it gained since proves that some step ran it, and a chunked prompt whose
later chunk kills the worker still counts, as its early chunks add no token.

At the bound, a sequence that was alone in the lost step (or with only its own request's other
sequences) ends with INTERNAL. Its blocks are gone with the worker's pool, and it is not requeued
anywhere. A sequence that shared the step with other requests may be innocent: it runs alone
next, as a suspect (Scheduler.fail_oldest). It ends if it is lost once more, alone or not, so
that a sequence whose killing chunk never runs alone still ends. Only the step that was running
counts. A plan queued behind it never ran.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.request import Request, Status

if TYPE_CHECKING:
    from scheduler.step import Step


def count_lost_step(running: Step | None, max_failures: int) -> list[Request]:
    """Before the scheduler's drain(): counts its running step against the sequences in it, and
    returns the requests to end with INTERNAL (each as the router knows it: a beam search as its
    handle). 0 or less: never ends one."""
    if max_failures <= 0 or running is None:
        return []
    ran: dict[int, tuple[Request, int]] = {}
    for req, _, _ in running.entries:
        if req.status is Status.FINISHED:
            continue
        # A group's sequences start again as its handle: how far its longest got.
        handle = req.group.handle
        ran[id(handle)] = (handle, max(s.num_tokens for s in req.group.seqs()))
    alone = len({seq.request_id for seq, _ in ran.values()}) == 1
    doomed = []
    for seq, length in ran.values():
        if length > seq.lost_at_length:
            seq.lost_steps = 0
        seq.lost_steps += 1
        seq.lost_at_length = length
        if seq.lost_steps > max_failures or (seq.lost_steps == max_failures and alone):
            doomed.append(seq)
        elif seq.lost_steps == max_failures:
            seq.suspect = True  # drain() keeps it: it waits apart on the next worker
    return doomed


def failed_message(seq: Request, max_failures: int) -> str:
    return (f"the step computing this sequence failed on {seq.lost_steps} workers in a row "
            f"(each died or timed out during it; --max-step-failures {max_failures})")
