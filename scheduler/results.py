"""A worker's StepResult applied to its scheduler: sequences advance, sampled tokens are appended
and checked for stops, full blocks enter the prefix cache, and tokens stream to the gateways.
This runs for every sequence every step, so the plain decode case is kept to one lean pass."""
from __future__ import annotations

from typing import TYPE_CHECKING

from proto import internal_pb2 as pb
from proto.columns import unpack
from scheduler.block_pool import hash_block
from scheduler.outbox import Outbox
from scheduler.request import FinishReason, Request, Status

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


def apply_result(sched: "Scheduler", result: pb.StepResult,
                 outboxes: dict[bytes, Outbox]) -> list[Request]:
    """Advance the sent plan's sequences, append sampled tokens, check stops, and stream
    each plain one-token step into its gateway's outbox. Returns the sequences with other
    news (first tokens, which carry usage, and finishes) for the caller to emit.

    One pass in plan order: the result lists the sampled slots in that order too."""
    bs, caching, RUNNING = sched.block_size, sched.pool.enable_prefix_caching, Status.RUNNING
    slots_column, tokens_column = unpack(result.slots), unpack(result.token_ids)
    if len(slots_column) != len(tokens_column):
        raise ValueError(f"step {result.step_id}: {len(slots_column)} slots but "
                         f"{len(tokens_column)} tokens")
    if result.logprobs:
        forward_logprobs(sched, result.logprobs, outboxes)
    entries, cols = sched.in_flight, sched.flight_cols
    sched.in_flight, sched.flight_cols = [], None
    if cols is not None and sched.num_running_ended != sched.flight_ended:
        # Some were aborted while the plan ran: the per-sequence path skips them.
        entries = entries + list(zip(cols.reqs, cols.n.tolist(), cols.slots.tolist()))
        cols = sched.cols = None
    # Each entry samples at most once, so with columns only that prefix concerns the loop below.
    head = len(entries) if cols is not None else len(slots_column)
    res_slots, res_tokens = slots_column[:head].tolist(), tokens_column[:head].tolist()
    j, num_results, others = 0, len(res_slots), []
    for req, n, slot in entries:
        alive = req.status is RUNNING  # else aborted while the plan ran
        if alive:
            computed = req.num_computed_tokens = req.num_computed_tokens + n
            if caching and computed // bs > len(req.block_hashes):
                cache_full_blocks(sched, [req])
        if j == num_results or res_slots[j] != slot:
            continue  # a prefill chunk that did not reach the end: nothing sampled
        token = res_tokens[j]
        j += 1
        if not alive:
            continue
        tokens = req.all_token_ids
        tokens.append(token)
        if token in req.stop_set and len(tokens) >= req.min_stop_len:
            sched.finish(req, FinishReason.STOP)
        elif len(tokens) >= req.length_limit:
            sched.finish(req, FinishReason.LENGTH)
        elif req.stream_started and not req.num_unstreamed:
            box = outboxes.get(req.gateway)
            if box is None:
                box = outboxes[req.gateway] = Outbox()
            box.add(req.request_id, req.index, [token])
            continue
        req.num_unstreamed += 1
        others.append(req)
    if cols is not None:
        cols.apply(sched, slots_column[j:], tokens_column[j:], outboxes, others)
    elif j != num_results:
        raise ValueError(f"step {result.step_id}: {num_results - j} sampled slots match no "
                         "sequence of the plan")
    return others


def forward_logprobs(sched: "Scheduler", logprobs, outboxes: dict[bytes, Outbox]) -> None:
    """Logprobs go to the gateway as the worker computed them, named by request rather than
    slot. This runs before any sequence of the step finishes, so every slot still names the
    sequence of the plan (a sequence aborted while the plan ran has none and is skipped)."""
    for lp in logprobs:
        req = sched.slots[lp.slot] if lp.slot < len(sched.slots) else None
        if req is None:
            continue
        lp.request_id, lp.index, lp.slot = req.request_id, req.index, 0
        box = outboxes.get(req.gateway)
        if box is None:
            box = outboxes[req.gateway] = Outbox()
        box.logprobs.append(lp)


def cache_full_blocks(sched: "Scheduler", reqs: list[Request]) -> None:
    """Make the blocks this step filled findable by later requests with the same prefix."""
    bs, filled, filled_hashes = sched.block_size, [], []
    for req in reqs:
        hashes, tokens = req.block_hashes, req.all_token_ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), req.num_computed_tokens // bs):
            parent = hash_block(parent, tokens[i * bs:(i + 1) * bs])
            hashes.append(parent)
            filled.append(req.block_ids[i])
            filled_hashes.append(parent)
    sched.pool.cache_blocks(filled, filled_hashes)
