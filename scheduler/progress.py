"""A sequence's progress: how many of its tokens are computed (num_computed_tokens, those of
plans still on the worker included) and how many sampled tokens are on their way back
(num_pending). Every write of them is a verb here, one per event, so that who moves them is
plain: the step takes tokens (scheduler/step.py), the results accept them
(scheduler/results.py), admission and forks start from what the KV manager found
(scheduler/sequence_group.py, scheduler/forks.py, scheduler/beam_search.py), and a recompute
or a failed step resets (scheduler/scheduler.py). The KV manager reads them and never writes.

There is no prefill or decode phase: num_computed_tokens chases the known tokens. That one rule
covers chunked prefill, prefix hits and recompute after preemption."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.request import Request


def take(req: Request, n: int) -> None:
    """A step computes req's next n tokens: they count now, so the next plan can follow this
    one; a step that reaches the end of its known tokens samples one, which pends."""
    computed = req.num_computed_tokens = req.num_computed_tokens + n
    if computed == len(req.all_token_ids) + req.num_pending:
        req.num_pending += 1


def accept(req: Request, cached: int = 0) -> None:
    """A step's sampled token came back (appended by the results); `cached`: accepted
    proposals before it, whose KV the step wrote, so they count as computed too."""
    req.num_pending -= 1
    if cached:
        req.num_computed_tokens += cached


def accept_all(reqs: list[Request]) -> None:
    """accept() for each of a result's rows that brought one token: one call for the step."""
    for req in reqs:
        req.num_pending -= 1


def found(req: Request, computed: int) -> None:
    """req starts on blocks the KV manager found for it: a prefix-cache hit at admission, or
    the parent's blocks it forked from."""
    req.num_computed_tokens = computed


def restart(req: Request) -> None:
    """req is computed again from its first token (a recompute, or an admission undone)."""
    req.num_computed_tokens = 0


def reset(req: Request) -> None:
    """req is computed again from its first token, and the plans that were to sample its
    pending tokens failed or were voided (or its worker is gone): none comes."""
    req.num_computed_tokens = req.num_pending = 0
