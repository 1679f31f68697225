"""A worker's StepResult applied to its scheduler: sampled tokens are appended and checked for
stops, full blocks enter the prefix cache, and tokens stream to the gateways. This runs for every
sequence every step, so the plain decode case is kept to one lean pass."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from proto import internal_pb2 as pb
from proto.columns import unpack_list
from scheduler.outbox import Outboxes
from scheduler.request import FinishReason, Request, Status
from scheduler.step import Step

if TYPE_CHECKING:
    from scheduler.sequence_group import Batch


def apply_result(sched: Batch, step: Step, result: pb.StepResult,
                 outboxes: Outboxes) -> list[Request]:
    """Append the step's sampled tokens, check stops, and stream each plain one-token step into
    its gateway's outbox. Returns the sequences with other news (first tokens, which carry
    usage, and finishes) for the caller to emit.

    One pass in plan order: the result lists the sampled slots in that order too. A sequence
    that ended while the step ran (a stop seen one result earlier, an abort) is skipped: the
    token it computed is dropped."""
    res_slots, res_tokens = unpack_list(result.slots), unpack_list(result.token_ids)
    runs = None  # speculative decoding: row j's tokens are res_tokens[runs[j]:runs[j + 1]]
    if result.num_tokens:
        runs = run_starts(sched, step, result, res_slots)
        drafts, most = unpack_list(result.num_drafts), sched.config.num_speculative_tokens
    elif len(res_slots) != len(res_tokens):
        raise ValueError(f"step {result.step_id}: {len(res_slots)} slots but {len(res_tokens)} tokens")
    candidates = forward_logprobs(step, result.logprobs, outboxes) if result.logprobs else {}
    RUNNING, kv = Status.RUNNING, sched.kv
    caching, block_size = kv.prefix_caching, kv.block_size
    j, num_results, others, picked = 0, len(res_slots), [], []
    streams: dict[bytes, tuple] = {}  # gateway -> its outbox's column appends, looked up once
    for req, _, slot in step.entries:
        if j == num_results or res_slots[j] != slot:
            continue  # a prefill chunk that did not reach the end: nothing sampled
        token = res_tokens[j] if runs is None else res_tokens[runs[j]]
        j += 1
        if req.status is Status.FINISHED:
            continue
        if runs is not None:
            start, end = runs[j - 1], runs[j]
            if drafts[j - 1] and req.draft is not None:
                req.draft.update(drafts[j - 1], end - start - 1, most)
            if end - start > 1:
                if accept_run(sched, req, res_tokens[start:end], outboxes, streams):
                    others.append(req)
                continue
        req.num_pending -= 1
        if req.group.picks_tokens:
            picked.append((req, slot))  # its candidates, not its sampled token, matter
            continue
        tokens = req.all_token_ids
        tokens.append(token)
        # A sequence preempted while the step ran keeps the token too (its recompute or swap-in
        # continues after it); only a running one has blocks to cache.
        if caching and req.status is RUNNING and \
                req.num_computed_tokens // block_size > req.num_cached_blocks:
            kv.cache_blocks(req)  # a block filled (the check is cache_blocks' own first line)
        if token in req.stop_set and len(tokens) >= req.min_stop_len:
            sched.finish(req, FinishReason.STOP)
        elif len(tokens) >= req.length_limit:
            sched.finish(req, FinishReason.LENGTH)
        elif req.final_only:  # its tokens wait for its finish: the gateway answers only then
            req.first_token_time = req.first_token_time or time.monotonic()
            req.num_unstreamed += 1
            continue
        elif req.stream_started and not req.num_unstreamed:
            appends = streams.get(req.gateway) or open_stream(streams, outboxes, req.gateway)
            add_id, add_index, add_count, add_offset, add_token = appends
            add_id(req.request_id)
            add_index(req.index)
            add_count(1)
            add_offset(len(tokens) - len(req.prompt_token_ids) - 1)
            add_token(token)
            continue
        req.num_unstreamed += 1
        others.append(req)
    if j != num_results:
        raise ValueError(f"step {result.step_id}: {num_results - j} sampled slots match no "
                         "sequence of the plan")
    if picked:
        others += pick_tokens(sched, picked, candidates)
    return others


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


def accept_run(sched: Batch, req: Request, run: list[int], outboxes: Outboxes,
               streams: dict[bytes, tuple]) -> bool:
    """A speculating row's accepted proposals and the target's token after them: their KV is in
    the cache up to the last one (which the next step computes), so the computed count moves by
    all but one. Tokens are taken one by one as in a plain step, so a stop id or the length limit
    inside the run ends the sequence exactly there, and the surplus is dropped. Streams the kept
    tokens as one entry; returns whether the caller must emit it (first tokens, a finish)."""
    req.num_pending -= 1
    if req.status is Status.RUNNING or req.status is Status.SWAPPED:
        req.num_computed_tokens += len(run) - 1
    tokens, kept = req.all_token_ids, 0
    for token in run:
        tokens.append(token)
        kept += 1
        if token in req.stop_set and len(tokens) >= req.min_stop_len:
            sched.finish(req, FinishReason.STOP)
            break
        if len(tokens) >= req.length_limit:
            sched.finish(req, FinishReason.LENGTH)
            break
    kv = sched.kv
    if kv.prefix_caching and req.status is Status.RUNNING:
        kv.cache_blocks(req)  # only the accepted tokens count as computed, so only they are hashed
    if req.final_only and req.status is not Status.FINISHED:  # its tokens wait for its finish
        req.first_token_time = req.first_token_time or time.monotonic()
        req.num_unstreamed += kept
        return False
    if req.status is Status.FINISHED or not req.stream_started or req.num_unstreamed:
        req.num_unstreamed += kept
        return True
    appends = streams.get(req.gateway) or open_stream(streams, outboxes, req.gateway)
    add_id, add_index, add_count, add_offset, add_token = appends
    add_id(req.request_id)
    add_index(req.index)
    add_count(kept)
    add_offset(len(tokens) - len(req.prompt_token_ids) - kept)
    for token in run[:kept]:
        add_token(token)
    return False


def open_stream(streams: dict[bytes, tuple], outboxes: Outboxes, gateway: bytes) -> tuple:
    """The column appends of a gateway's outbox, looked up once per result."""
    appends = streams[gateway] = outboxes[gateway].appends()
    return appends


def pick_tokens(sched: Batch, picked: list[tuple[Request, int]],
                candidates: dict[int, pb.Logprobs]) -> list[Request]:
    """The candidates of sequences whose groups pick their tokens (a beam search), by their slot
    in the step. Returns the handles of the groups that ended."""
    groups = []
    for seq, slot in picked:
        group = seq.group
        if group.add_candidates(seq, candidates.get(slot)) and group not in groups:
            groups.append(group)
    return [group.handle for group in groups if group.on_result(sched)]


def forward_logprobs(step: Step, logprobs, outboxes: Outboxes) -> dict[int, pb.Logprobs]:
    """Logprobs go to the gateway as the worker computed them, named by request rather than
    slot (the step's own entries say whose slot it was when the plan went out). Those of a group
    that picks its tokens (a beam search) are its candidates: they are returned by slot."""
    by_slot = {slot: req for req, _, slot in step.entries}
    candidates = {}
    for lp in logprobs:
        req = by_slot.get(lp.slot)
        if req is None or req.status is Status.FINISHED:
            continue
        if req.group.picks_tokens:
            if not lp.prompt:
                candidates[lp.slot] = lp
            continue
        lp.request_id, lp.index, lp.slot = req.request_id, req.index, 0
        box = outboxes[req.gateway]
        box.logprobs.append(lp)
    return candidates
