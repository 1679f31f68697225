"""A worker's StepResult applied to its scheduler: each sampled row goes to its sequence's group
(SequenceGroup.on_sampled), and a plain sequence accepts its tokens here (`accept`): appended,
checked for stops, full blocks into the prefix cache, and out to the stream's owner
(scheduler/stream.py). This runs for every sequence every step, so the plain decode case is kept
to one lean pass."""
from __future__ import annotations

from typing import TYPE_CHECKING

from proto import internal_pb2 as pb
from proto.columns import unpack_list
from scheduler import progress
from scheduler.request import FinishReason, Request, Status
from scheduler.step import Step

if TYPE_CHECKING:
    from scheduler.batch import Batch

# Looked up once: an Enum member read through its class costs more than a call, and these are
# read for every row of every result.
FINISHED, RUNNING, SWAPPED = Status.FINISHED, Status.RUNNING, Status.SWAPPED


def apply_result(sched: Batch, step: Step, result: pb.StepResult) -> list[Request]:
    """Hand each sampled row to its group, in plan order (the result lists the sampled slots in
    that order too), and the step's logprobs before them. Returns the sequences, or the handles
    of groups, that ended.

    A sequence that ended while the step ran (a stop seen one result earlier, an abort) is
    skipped: the token it computed is dropped."""
    res_slots, res_tokens = unpack_list(result.slots), unpack_list(result.token_ids)
    if not result.num_tokens and len(res_slots) != len(res_tokens):
        raise ValueError(f"step {result.step_id}: {len(res_slots)} slots but {len(res_tokens)} tokens")
    if result.logprobs:
        deliver_logprobs(sched, step, result.logprobs)
    ended, settle = [], []
    # Two loops, not one with a branch per row: the one-token loop is every plain decode's.
    rows = sampled_runs if result.num_tokens else sampled_tokens
    j = rows(sched, step, result, res_slots, res_tokens, ended, settle)
    if j != len(res_slots):
        raise ValueError(f"step {result.step_id}: {len(res_slots) - j} sampled slots match no "
                         "sequence of the plan")
    ended += [group.handle for group in settle if group.settle(sched)]
    sched.streams.flush()
    return ended


def sampled_tokens(sched: Batch, step: Step, result: pb.StepResult, res_slots: list[int],
                   res_tokens: list[int], ended: list[Request],
                   settle: list) -> int:
    """A result of one token per row to the rows' groups: adds the sequences that ended to
    `ended` and the groups to settle to `settle`. Returns the rows matched."""
    j, num_results = 0, len(res_slots)
    accepted = []  # the rows' progress moves once for the step (nothing below reads it)
    accept_one = accepted.append
    for req, _, slot in step.entries:
        if j == num_results or res_slots[j] != slot:
            continue  # a prefill chunk that did not reach the end: nothing sampled
        token = res_tokens[j]
        j += 1
        if req.status is FINISHED:
            continue
        accept_one(req)
        group = req.group
        if group.on_sampled(sched, req, [token]):
            if group not in settle:
                settle.append(group)
        elif req.status is FINISHED:
            ended.append(req)
    progress.accept_all(accepted)
    return j


def sampled_runs(sched: Batch, step: Step, result: pb.StepResult, res_slots: list[int],
                 res_tokens: list[int], ended: list[Request],
                 settle: list) -> int:
    """sampled_tokens() for a speculative step: row j's tokens are
    res_tokens[runs[j]:runs[j + 1]], the accepted proposals and the target's token."""
    runs = run_starts(sched, step, result, res_slots)
    drafts, most = unpack_list(result.num_drafts), sched.config.num_speculative_tokens
    j, num_results = 0, len(res_slots)
    for req, _, slot in step.entries:
        if j == num_results or res_slots[j] != slot:
            continue  # a prefill chunk that did not reach the end: nothing sampled
        status = req.status
        start, end = runs[j], runs[j + 1]
        if drafts[j] and req.draft is not None and status is not FINISHED:
            req.draft.update(drafts[j], end - start - 1, most)
        j += 1
        if status is FINISHED:
            continue
        # The run's KV is in the cache up to its last token (which the next step computes);
        # a sequence preempted while the step ran keeps it only if it keeps its blocks, and
        # counts it before the tokens, whose blocks are cached by it.
        progress.accept(req, end - start - 1 if status is RUNNING or status is SWAPPED else 0)
        group = req.group
        if group.on_sampled(sched, req, res_tokens[start:end]):
            if group not in settle:
                settle.append(group)
        elif req.status is FINISHED:
            ended.append(req)
    return j


def accept(sched: Batch, req: Request, tokens: list[int]) -> bool:
    """A plain sequence's sampled token, or a speculating row's accepted proposals and the
    target's token after them (apply_result moved its progress). Tokens are taken one by one,
    so a stop id or the length limit inside a run ends the sequence exactly there, and the
    surplus is dropped. A sequence preempted while the step ran keeps them too (its recompute or swap-in
    continues after them); only a running one has blocks to cache. False: nothing to settle
    (SequenceGroup.on_sampled)."""
    all_ids, kv = req.all_token_ids, sched.kv
    if len(tokens) == 1:
        token = tokens[0]
        all_ids.append(token)
        if kv.prefix_caching and req.status is RUNNING and \
                req.num_computed_tokens // kv.block_size > req.num_cached_blocks:
            kv.cache_blocks(req)  # a block filled (the check is cache_blocks' own first line)
        if token in req.stop_set and len(all_ids) >= req.min_stop_len:
            reason = FinishReason.STOP
        elif len(all_ids) >= req.length_limit:
            reason = FinishReason.LENGTH
        else:
            sched.streams.tokens(req.stream, tokens, req)
            return False
        sched.streams.tokens(req.stream, tokens, req)
        _end(sched, req, reason)
        return False
    reason, kept = None, 0
    for token in tokens:
        all_ids.append(token)
        kept += 1
        if token in req.stop_set and len(all_ids) >= req.min_stop_len:
            reason = FinishReason.STOP
            break
        if len(all_ids) >= req.length_limit:
            reason = FinishReason.LENGTH
            break
    if reason is not None:
        sched.finish(req, reason)
    if kv.prefix_caching and req.status is RUNNING:
        kv.cache_blocks(req)  # only the accepted tokens count as computed, so only they are hashed
    sched.streams.tokens(req.stream, tokens[:kept], req)
    if reason is not None:
        sched.streams.end(req.stream, req, int(reason))
    return False


def _end(sched: Batch, req: Request, reason: FinishReason) -> None:
    sched.finish(req, reason)
    sched.streams.end(req.stream, req, int(reason))


def run_starts(sched: Batch, step: Step, result: pb.StepResult, slots: list[int]) -> list[int]:
    """Where each row's run of tokens starts in result.token_ids, and the end: [0, ..., n].
    message_checks.check_result saw that the runs cover the tokens; here, that no row accepted
    more proposals than the plan gave it slots for (the blocks hold no more)."""
    counts = unpack_list(result.num_tokens)
    sched.speculation.record(counts, unpack_list(result.num_drafts))
    room = dict(zip(step.spec_slots, step.spec_num_tokens))
    starts = [0] * (len(slots) + 1)
    for i, (slot, c) in enumerate(zip(slots, counts)):
        if c > 1 + room.get(slot, 0):
            raise ValueError(f"step {result.step_id}: slot {slot} accepted {c - 1} proposals, "
                             f"planned {room.get(slot, 0)}")
        starts[i + 1] = starts[i] + c
    return starts


def deliver_logprobs(sched: Batch, step: Step, logprobs) -> None:
    """Each logprobs message to its sequence's group, by the slot the step's entries say was
    whose when the plan went out."""
    by_slot = {slot: req for req, _, slot in step.entries}
    for lp in logprobs:
        req = by_slot.get(lp.slot)
        if req is not None and req.status is not FINISHED:
            req.group.on_logprobs(sched, req, lp)
