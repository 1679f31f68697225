"""Beam search, owned by the scheduler: a request's live beams are ordinary sequences of its
worker's batch that share blocks copy-on-write, and the search itself is transformers'
`_beam_search` (generation/utils.py, 5.x) for one prompt, step for step:

- the worker returns, for every live beam that reached the end of its tokens, its top K next
  tokens and their logprobs (SamplingConfig.beam_candidates = K, K = max(2, 1 + #EOS) x width,
  transformers' `beams_to_keep`) and leaves its own sampled token out of its copy;
- once every live beam has its candidates, `advance` ranks cumulative logprobs, keeps the top K,
  marks those that end (an EOS or stop id, or max length), continues the best `width` that do not,
  and offers the ended ones among the top `width` to the finished hypotheses with the score
  sum / generated_length ** length_penalty; transformers' early-stop heuristic and
  early_stopping ("true", "false", "never") decide when the search is over;
- a beam that continues one way keeps its sequence (its next token goes in the plan:
  StepPlan.next_token_*), each further way forks it (every block shared, KVCacheManager.share),
  and a beam with no continuation is freed. A shared partial block is copied only when a beam
  writes into it (KVCacheManager.write_slots), the beams new to the worker first, so the beam that
  stays in place keeps the original.

A group never runs one plan ahead: its next tokens are only known once its result is in. It is
preempted, aborted and requeued as a whole, and always by recompute: its full blocks are cached,
so the recompute finds (and shares again) most of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from proto import internal_pb2 as pb
from proto.columns import unpack_f32, unpack_list
from scheduler.request import FinishReason, Request, Status

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler
    from scheduler.step import Step

_F32 = np.float32


@dataclass
class Hypothesis:
    token_ids: list[int]      # output tokens, the ending one included
    score: float              # cum_logprob / generated_length ** length_penalty (float32)
    cum_logprob: float
    finish: FinishReason


@dataclass(eq=False)
class BeamGroup:
    handle: Request           # the request as the router knows it (never in the batch)
    width: int
    length_penalty: float
    early_stopping: str       # "true", "false" or "never"
    num_candidates: int       # K, asked of the worker per beam
    prompt_len: int
    max_length: int           # prompt + max_tokens, or max_model_len
    cur_len: int
    beams: list[Request] = field(default_factory=list)   # live, best first
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    candidates: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # by id(beam)
    improvable: bool = True   # transformers' is_early_stop_heuristic_unsatisfied
    results: list[Hypothesis] | None = None
    planned_in: "Step | None" = None  # the step that last scheduled the group
    next_beam: int = 1


def start(sched: "Scheduler", handle: Request) -> None:
    """A beam request arrives: one beam, the prompt; it forks once the prompt's candidates come."""
    p = handle.beam_params
    sampling = pb.SamplingConfig()
    sampling.CopyFrom(handle.sampling)
    beam0 = Request(seq_id=f"{handle.request_id}#b0", request_id=handle.request_id, index=0,
                    gateway=handle.gateway, prompt_token_ids=handle.prompt_token_ids,
                    sampling=sampling, max_tokens=handle.max_tokens, ignore_eos=handle.ignore_eos,
                    stop_token_ids=handle.stop_token_ids, priority=handle.priority,
                    arrival=handle.arrival, public_id=handle.public_id,
                    cache_salt=handle.cache_salt, arrival_time=handle.arrival_time,
                    worker=handle.worker, suspect=handle.suspect)  # lost_steps.py: it runs alone
    handle.suspect = False
    sched.add(beam0)
    k = max(2, 1 + len(beam0.stop_set)) * p.beam_width
    sampling.beam_candidates = k
    group = BeamGroup(handle, p.beam_width, p.length_penalty if p.HasField("length_penalty") else 1.0,
                      p.early_stopping or "false", k, beam0.num_prompt_tokens, beam0.length_limit,
                      beam0.num_prompt_tokens, beams=[beam0])
    beam0.beam = handle.beam = group
    handle.status = Status.WAITING
    sched.groups[handle.seq_id] = group


# -- scheduling ---------------------------------------------------------------------------------
def schedule(sched: "Scheduler", group: BeamGroup, step: "Step") -> None:
    """The group's tokens for this step: one each after an advance, or recompute chunks. All or
    none get their blocks, so a preemption never splits the group inside a step."""
    if group.planned_in is step:
        return  # its first beam in the running list scheduled it
    group.planned_in = step
    beams = group.beams
    if any(b.status is not Status.RUNNING or b.num_pending for b in beams):
        return  # its last step is still on the worker
    # New to the worker first: they copy a shared partial block, the held beam keeps it.
    todo = sorted((b for b in beams if b.num_computed_tokens < b.num_tokens), key=lambda b: b.on_worker)
    work, budget = [], step.budget
    for b in todo:
        n = min(b.num_tokens - b.num_computed_tokens, budget)
        if n == 0:
            break
        work.append((b, n))
        budget -= n
    if not work:
        return
    while sched.kv.write_cost(work) > sched.kv.pool.num_free:
        if not sched.preempt_for(work[0][0], step):
            return  # the group itself was the lowest-priority sequence left
    for b, n in work:
        blocks, copy = sched.kv.write_slots(b, n)
        if copy is not None:
            step.copy.append(copy)
        if b.token_unsent and b.on_worker:
            step.next_token_slots.append(b.slot)
            step.next_token_ids.append(b.all_token_ids[-1])
        b.token_unsent = False
        step.take(b, n, blocks)


def admit(sched: "Scheduler", group: BeamGroup, step: "Step") -> bool:
    """A waiting group (new, or preempted) joins the batch whole, each beam with its prefix-cache
    hits, or not at all. False: not now (strict order: nothing behind it goes first)."""
    beams, kv = group.beams, sched.kv
    if any(b.num_pending for b in beams):
        return False  # a result of before its preemption is still on the way
    if len(sched.running) + len(step.forked) + reserved(sched) + group.width > sched.config.max_num_seqs:
        return False
    budget, taken = step.budget, []
    for b in beams:
        hits = kv.get_computed_blocks(b)
        n = min(b.num_tokens - len(hits) * kv.block_size, budget)
        blocks = kv.allocate_slots(b, n, hits)
        if blocks is None:
            for t, _, _ in taken:
                kv.free(t)
                t.num_computed_tokens = 0
            return False
        taken.append((b, n, blocks))
        budget -= n
    for b, n, blocks in taken:
        if b.num_cached_tokens < 0:
            b.num_cached_tokens = b.num_computed_tokens
            kv.pool.queries += b.num_tokens
            kv.pool.hits += b.num_computed_tokens
        sched.num_waiting -= 1
        sched.start_running(b)
        if n:
            step.take(b, n, blocks)
    group.handle.status = Status.RUNNING
    return True


def reserved(sched: "Scheduler") -> int:
    """Sequences the running groups may still fork into: room kept for them under max_num_seqs."""
    return sum(g.width - len(g.beams) for g in sched.groups.values()
               if g.handle.status is Status.RUNNING)


def preempt(sched: "Scheduler", group: BeamGroup, step: "Step") -> None:
    """Recompute, for the whole group: the candidates of a step still running are dropped when
    they come, and recomputed with the rest."""
    step.preempted = True
    sched.stats.num_preemptions["recompute"] += 1
    requeue(sched, group)


def requeue(sched: "Scheduler", group: BeamGroup) -> None:
    for b in group.beams:
        if b.status is Status.RUNNING:
            sched.kv.free(b)
            sched.drop_slot(b)
            b.status = Status.WAITING
            sched.num_waiting += 1
        b.num_computed_tokens = 0
        b.token_unsent = False
        b.num_preemptions += 1
    group.candidates.clear()
    group.handle.status = Status.WAITING
    group.handle.num_preemptions += 1
    sched.enqueue(group.beams[0])  # the others wait off the queue; admit() takes them all


def end(sched: "Scheduler", group: BeamGroup, reason: FinishReason) -> None:
    """Every way a group ends: its live beams are freed, the handle finishes."""
    handle = group.handle
    if group.beams:  # what the first beam's admission measured
        handle.queue_time = group.beams[0].queue_time
        handle.num_cached_tokens = group.beams[0].num_cached_tokens
    for b in group.beams:
        sched.finish(b, reason)
    group.beams = []
    handle.status, handle.finish_reason = Status.FINISHED, reason
    sched.groups.pop(handle.seq_id, None)


def final_deltas(handle: Request, error: pb.Error | None) -> list[pb.TokenDelta]:
    """The end of a beam search: one delta per index with its whole output, best first (an abort
    or error: every index ends with it)."""
    results = handle.beam.results if handle.beam is not None and handle.beam.results else []
    out = []
    for i in range(handle.beam_params.beam_width):
        delta = pb.TokenDelta(
            request_id=handle.request_id, index=i, prompt_tokens=handle.num_prompt_tokens,
            cached_prompt_tokens=max(0, handle.num_cached_tokens),
            queue_time_s=max(0.0, handle.queue_time), num_preemptions=handle.num_preemptions,
            finish=int(handle.finish_reason or FinishReason.ABORT))
        if i < len(results):
            delta.token_ids.extend(results[i].token_ids)
            delta.finish, delta.cumulative_logprob = int(results[i].finish), results[i].cum_logprob
        if error is not None:
            delta.error.CopyFrom(error)
        out.append(delta)
    return out


# -- results ------------------------------------------------------------------------------------
def on_results(sched: "Scheduler", beams: list[tuple[Request, int]],
               logprobs: dict[int, pb.Logprobs]) -> list[Request]:
    """Candidates of beams that reached their end in a step, (beam, its slot in that step).
    Returns the handles of groups whose search ended."""
    groups = []
    for b, slot in beams:
        group, lp = b.beam, logprobs.get(slot)
        if b.status is not Status.RUNNING or lp is None or group is None:
            continue  # preempted while the step ran: recomputed with its group
        ids, values, k = unpack_list(lp.top_token_ids), unpack_f32(lp.top_logprobs), lp.k
        group.candidates[id(b)] = list(zip(ids[:k], values[:k]))
        if group not in groups:
            groups.append(group)
    done = []
    for group in groups:
        if group.handle.status is not Status.FINISHED and \
                all(id(b) in group.candidates for b in group.beams):
            if advance(sched, group):
                done.append(group.handle)
    return done


def advance(sched: "Scheduler", group: BeamGroup) -> bool:
    """One step of transformers' beam search (batch size 1). Returns True when it is over."""
    width, k, lp_pow = group.width, group.num_candidates, group.length_penalty
    stop_set = group.beams[0].stop_set
    cands = []  # (total, beam order, rank, beam, token)
    for i, b in enumerate(group.beams):
        for rank, (token, lp) in enumerate(group.candidates.pop(id(b))):
            cands.append((_F32(b.cum_logprob) + _F32(lp), i, rank, b, token))
    top = sorted(cands, key=lambda c: (-c[0], c[1], c[2]))[:k]
    at_max = group.cur_len + 1 >= group.max_length
    ends = [at_max or c[4] in stop_set for c in top]
    running = [c for c, e in zip(top, ends) if not e][:width]
    # Only the top `width` candidates may finish; the rest are there to keep `width` running.
    denom = (group.cur_len + 1 - group.prompt_len) ** lp_pow
    new = [Hypothesis(c[3].all_token_ids[group.prompt_len:] + [c[4]], _F32(c[0] / _F32(denom)),
                      float(c[0]), FinishReason.STOP if c[4] in stop_set else FinishReason.LENGTH)
           for c, e in zip(top[:width], ends[:width]) if e]
    if new:
        group.finished = sorted(group.finished + new, key=lambda h: -h.score)[:width]
    group.cur_len += 1
    if running:
        best_len = (group.max_length if group.early_stopping == "never" and lp_pow > 0.0
                    else group.cur_len) - group.prompt_len
        best_possible = _F32(running[0][0] / _F32(best_len ** lp_pow))
        if len(group.finished) == width:
            group.improvable = group.improvable and best_possible > min(h.score for h in group.finished)
    full = group.early_stopping == "true" and len(group.finished) == width
    if all(ends) or not group.improvable or full:
        group.results = list(group.finished)
        end(sched, group, FinishReason.STOP)
        return True
    _continue(sched, group, running)
    return False


def _continue(sched: "Scheduler", group: BeamGroup, running) -> None:
    """The next live beams: forks first (from each parent's tokens before its own next one),
    then the beams without a continuation leave, then the parents take their best token."""
    kept: dict[int, Request] = {}
    live = []
    for total, _, _, parent, token in running:
        if id(parent) not in kept:
            kept[id(parent)] = parent
            live.append((parent, token, total))
            continue
        child = _fork(sched, group, parent, token)
        child.cum_logprob = total
        live.append((child, None, total))
    for b in group.beams:
        if id(b) not in kept:
            sched.finish(b, FinishReason.STOP)  # dropped out of the beam
    for b, token, total in live:
        if token is not None:
            b.all_token_ids.append(token)
            b.cum_logprob = total
            b.token_unsent = True
        sched.kv.cache_blocks(b)
    group.beams = [b for b, _, _ in live]
    sched.running = sorted((r for r in sched.running if r.status is Status.RUNNING), key=Request.sort_key)


def _fork(sched: "Scheduler", group: BeamGroup, parent: Request, token: int) -> Request:
    child = Request(seq_id=f"{group.handle.request_id}#b{group.next_beam}",
                    request_id=parent.request_id, index=0, gateway=parent.gateway,
                    prompt_token_ids=parent.prompt_token_ids, sampling=parent.sampling,
                    max_tokens=parent.max_tokens, ignore_eos=parent.ignore_eos,
                    stop_token_ids=parent.stop_token_ids, priority=parent.priority,
                    arrival=parent.arrival, public_id=parent.public_id,
                    cache_salt=parent.cache_salt, arrival_time=parent.arrival_time,
                    queue_time=parent.queue_time, all_token_ids=parent.all_token_ids + [token],
                    status=Status.RUNNING, stop_set=parent.stop_set,
                    length_limit=parent.length_limit, min_stop_len=parent.min_stop_len,
                    worker=parent.worker, num_cached_tokens=parent.num_cached_tokens,
                    num_preemptions=parent.num_preemptions, beam=group)
    group.next_beam += 1
    sched.kv.share(parent, child)
    sched.requests[child.seq_id] = child
    sched.running.append(child)
    return child
