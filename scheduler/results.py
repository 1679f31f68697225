"""A worker's StepResult applied to its scheduler: sequences advance, sampled tokens are appended
and checked for stops, full blocks enter the prefix cache, and tokens stream to the gateways.
This runs for every sequence every step, so the plain decode case is kept to one lean pass."""
from __future__ import annotations

from typing import TYPE_CHECKING

from proto import internal_pb2 as pb
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
    res_slots, res_tokens = list(result.slots), list(result.token_ids)
    j, num_results, others = 0, len(res_slots), []
    for req, n, slot in sched.in_flight:
        alive = req.status is RUNNING  # else aborted while the plan ran
        if alive:
            computed = req.num_computed_tokens = req.num_computed_tokens + n
            if caching and computed // bs > len(req.block_hashes):
                cache_full_blocks(sched, req)
        if j == num_results or res_slots[j] != slot:
            continue  # a prefill chunk that did not reach the end: nothing sampled
        token = res_tokens[j]
        j += 1
        if not alive:
            continue
        out, tokens = req.output_token_ids, req.all_token_ids
        out.append(token)
        tokens.append(token)
        if token in req.stop_set:
            sched.finish(req, FinishReason.STOP)
        elif len(tokens) >= req.length_limit:
            sched.finish(req, FinishReason.LENGTH)
        elif req.num_streamed and len(out) - req.num_streamed == 1:
            box = outboxes.get(req.gateway)
            if box is None:
                box = outboxes[req.gateway] = Outbox()
            box.request_ids.append(req.request_id)
            box.indices.append(req.index)
            box.num_tokens.append(1)
            box.token_ids.append(token)
            req.num_streamed += 1
            continue
        others.append(req)
    if j != num_results:
        raise ValueError(f"step {result.step_id}: {num_results - j} sampled slots match no "
                         "sequence of the plan")
    sched.in_flight = []
    return others


def cache_full_blocks(sched: "Scheduler", req: Request) -> None:
    """Make the blocks this step filled findable by later requests with the same prefix."""
    bs = sched.block_size
    parent = req.block_hashes[-1] if req.block_hashes else None
    for i in range(len(req.block_hashes), req.num_computed_tokens // bs):
        parent = hash_block(parent, req.all_token_ids[i * bs:(i + 1) * bs])
        req.block_hashes.append(parent)
        sched.pool.cache_block(req.block_ids[i], parent)
