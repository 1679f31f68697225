"""One worker's continuous-batching policy: which sequences compute how many tokens each step.

Each registered worker gets its own Scheduler and KVCacheManager; the router (router.py) decides
which worker a request goes to, this file everything after. A step has three phases, in this
order: running sequences (preempting when blocks run out), then swapped sequences coming back,
then waiting ones (reusing cached prefix blocks).

One plan ahead: schedule() may run while the previous plan is still on the worker. A sequence's
computed count moves when it is scheduled, and a step that samples leaves a token "pending": the
worker feeds it into the next step itself, and the scheduler appends it when the result arrives
(results.py). Stops therefore lag one step; the token a finished sequence computes in the step
after is dropped.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass

from proto import internal_pb2 as pb
from scheduler import beam, failures
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.outbox import Outbox
from scheduler.preemption import PreemptionPolicy
from scheduler.request import FinishReason, Request, Status
from scheduler.results import apply_result
from scheduler.step import Step

log = logging.getLogger("pagoda.scheduler")


@dataclass
class SchedulerConfig:
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    eos_token_ids: frozenset[int] = frozenset()
    num_cpu_blocks: int = 0            # swap space; 0 = recompute only
    bytes_per_block: int = 0
    swap_bytes_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    max_plans_in_flight: int = 2       # 2 = one plan ahead; 1 = wait for each result


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, first_step_id: int = 0) -> None:
        self.config = config
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 config.num_cpu_blocks)
        self.preemption = PreemptionPolicy(config, self.kv)
        self.waiting: list[tuple[int, int, int, Request]] = []  # heap: priority, arrival, tiebreak
        self._tiebreak = itertools.count()
        self.running: list[Request] = []                     # in priority order
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}               # every unfinished sequence here
        self.num_waiting = 0  # of those, the ones in status WAITING (fork children included)
        # Slots name sequences in plans and results. A released slot is reused only once every
        # plan sent before its release has come back, so a result never names the wrong one.
        self.slots: list[Request | None] = []
        self.free_slots: list[int] = []
        self.released: list[tuple[int, int]] = []            # (last plan sent, slot)
        self.dropped: list[int] = []                         # slots the next plan makes it forget
        self.in_flight: deque[Step] = deque()                # plans sent, results not yet back
        self.last_result_at = 0.0  # monotonic: the worker starts the next plan in flight then
        # Each registration starts its ids where no earlier one reached (the router's epoch), so a
        # result from before a worker registered again never matches a plan of this one.
        self.step_id = first_step_id
        # Waiting or running sequences of a failed step, kept off the waiting queue: each runs
        # alone until a step with it succeeds (scheduler/failures.py).
        self.suspects: list[Request] = []
        self.groups: dict[str, beam.BeamGroup] = {}          # beam searches, by handle seq_id

    # -- intake -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.beam_params is not None:
            return beam.start(self, req)  # the router's handle: its beams are added there
        eos = frozenset() if req.ignore_eos else self.config.eos_token_ids
        req.stop_set = eos | req.stop_token_ids
        # The first output token sits at index num_prompt_tokens; with min_tokens m, output
        # tokens 0..m-1 cannot stop it (the worker masks them, see SamplingConfig).
        req.min_stop_len = req.num_prompt_tokens + req.sampling.min_tokens + 1
        if req.sampling.min_tokens:
            req.sampling.stop_token_ids[:] = sorted(req.stop_set)
        req.length_limit = min(req.num_prompt_tokens + req.max_tokens, self.config.max_model_len)
        req.status = Status.WAITING
        self.num_waiting += 1
        self.requests[req.seq_id] = req
        if req.fork_parent is None:
            self.enqueue(req)
        # A fork child waits, off the queue, for its parent to compute the prompt.

    def enqueue(self, req: Request) -> None:
        """A WAITING sequence joins the waiting queue, or the suspects."""
        if req.suspect:
            self.suspects.append(req)
        else:
            heapq.heappush(self.waiting, (req.priority, req.arrival, next(self._tiebreak), req))

    def abort(self, seq_id: str) -> Request | None:
        if seq_id in self.groups:
            group = self.groups[seq_id]
            beam.end(self, group, FinishReason.ABORT)
            return group.handle
        req = self.requests.get(seq_id)
        if req is not None:
            self.finish(req, FinishReason.ABORT)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.requests) or bool(self.dropped)

    @property
    def can_plan(self) -> bool:
        return len(self.in_flight) < self.config.max_plans_in_flight

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> pb.StepPlan | None:
        step = Step(self.step_id + 1, self.config.max_num_batched_tokens)
        self.running = [r for r in self.running if r.status is Status.RUNNING]
        if self.suspects:
            self.suspects = [r for r in self.suspects if r.suspect and r.status is not Status.FINISHED]
        if self.suspects:
            if self.in_flight:
                return None  # a suspect's step runs alone: let the pipeline drain first
            if failures.schedule_alone(self, step):
                return self._send(step)
        self._schedule_running(step)
        # A step that had to preempt admits nothing: the victims would come straight back.
        if not step.preempted:
            self._schedule_swapped(step)
            if not self.swapped:  # swapped sequences resume before any new one is admitted
                self._schedule_waiting(step)
        if step.forked:  # they joined this step already; no phase above may schedule them again
            self.running += step.forked
            self.running.sort(key=Request.sort_key)
        step.dropped, self.dropped = self.dropped, []
        if step.is_empty():
            self.dropped = step.dropped
            return None
        return self._send(step)

    def _send(self, step: Step) -> pb.StepPlan:
        if step.alone:
            step.dropped, self.dropped = self.dropped, []
        self.step_id += 1
        now = time.monotonic() if step.new else 0.0
        for req, _ in step.new:
            if req.queue_time < 0:
                req.queue_time = now - req.arrival_time
            self._assign_slot(req)
        plan = step.plan()
        step.sent_at = time.monotonic()
        self.in_flight.append(step)
        return plan

    def _schedule_running(self, step: Step) -> None:
        """The next token, or the next prefill chunk, for every running sequence."""
        for req in self.running:  # preemption and forks leave the list itself alone
            if step.budget == 0:
                break
            if req.status is not Status.RUNNING or req.suspect:
                continue  # a victim earlier in this loop, or a suspect (it runs alone)
            if req.beam is not None:
                beam.schedule(self, req.beam, step)  # no plan ahead: its tokens are chosen here
                continue
            known = len(req.all_token_ids) + req.num_pending
            if known >= req.length_limit:
                continue  # its last token is on the way; it ends when that arrives
            todo = known - req.num_computed_tokens
            if req.fork_children:
                if todo == 1:
                    self._fork(req, step)
                    continue
                todo -= 1  # the children fork at the prompt's last token
            if todo <= 0:
                continue
            n = min(todo, step.budget)
            blocks = self.kv.allocate_slots(req, n)
            while blocks is None and self.preempt_for(req, step):
                blocks = self.kv.allocate_slots(req, n)
            if blocks is not None:
                step.take(req, n, blocks)

    def preempt_for(self, req: Request, step: Step) -> bool:
        """Preempt the lowest-priority, latest-arrived running sequence not yet given work this
        step (the list is in that order). Returns False once req (or its beam group) was it."""
        victim = next(r for r in reversed(self.running) if r.status is Status.RUNNING)
        self.preempt(victim, step)
        return victim is not req and (victim.beam is None or victim.beam is not req.beam)

    def _fork(self, parent: Request, step: Step, may_preempt: bool = True) -> None:
        """The parent computes its prompt's last token and its children start from there, sharing
        its blocks; one token each, if the step has room for all of them. Only the running phase
        may preempt for it: a sequence admitted in this step must not leave again in it."""
        children = parent.fork_children
        room = self.config.max_num_seqs - len(self.running) - len(step.forked) - \
            beam.reserved(self) >= len(children)
        if not room or 1 + len(children) > step.budget:
            return  # a later step forks it
        while self.kv.fork_cost(parent, len(children), 1) > self.kv.pool.num_free:
            if not may_preempt or not self.preempt_for(parent, step):
                return
        blocks = self.kv.allocate_slots(parent, 1)
        for child in children:  # from the parent's state before this step's token
            copy = self.kv.fork(parent, child)
            if copy is not None:
                step.copy.append(copy)
            child.num_cached_tokens = parent.num_cached_tokens
            child.fork_parent = None
            child.status = Status.RUNNING
            self.num_waiting -= 1
            step.take(child, 1, [])
        step.take(parent, 1, blocks)
        parent.fork_children = []
        step.forked += children

    def _room_for(self, req: Request, step: Step) -> bool:
        seqs = len(self.running) + len(step.forked) + 1 + len(req.fork_children) + beam.reserved(self)
        return seqs <= self.config.max_num_seqs

    def _schedule_swapped(self, step: Step) -> None:
        self.swapped.sort(key=Request.sort_key)
        while self.swapped and step.budget > 0 and self._room_for(self.swapped[0], step):
            req = self.swapped[0]
            if req.num_pending:
                return  # its last token is still on the way
            n = min(req.num_tokens - req.num_computed_tokens - bool(req.fork_children), step.budget)
            ops = self.kv.swap_in(req, n)
            if ops is None:
                return
            self.swapped.pop(0)
            step.swap_in += ops
            self.start_running(req)
            self.take_or_fork(req, n, [], step)

    def _schedule_waiting(self, step: Step) -> None:
        while self.waiting and step.budget > 0:
            req = self.waiting[0][-1]
            if req.status is not Status.WAITING or req.suspect:
                heapq.heappop(self.waiting)  # aborted while waiting, or now waits as a suspect
                continue
            if req.beam is not None:  # a beam search joins whole
                if not beam.admit(self, req.beam, step):
                    return
                heapq.heappop(self.waiting)
                continue
            if req.num_pending or not self._room_for(req, step):
                return  # strict priority order: nothing jumps the queue
            hits = self.kv.get_computed_blocks(req)
            # A parent with children to fork stops one short of its prompt's end.
            n = min(req.num_tokens - len(hits) * self.config.block_size - bool(req.fork_children),
                    step.budget)
            blocks = self.kv.allocate_slots(req, n, hits)
            if blocks is None:
                return
            heapq.heappop(self.waiting)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
                self.kv.pool.queries += req.num_tokens
                self.kv.pool.hits += req.num_computed_tokens
            self.num_waiting -= 1
            self.start_running(req)
            self.take_or_fork(req, n, blocks, step)

    def take_or_fork(self, req: Request, n: int, blocks: list[int], step: Step) -> None:
        """A sequence that just (re)joined the batch: its chunk, or, when only its prompt's last
        token is left and children wait, the fork."""
        if n > 0:
            step.take(req, n, blocks)
        elif req.fork_children:
            self._fork(req, step, may_preempt=False)

    def start_running(self, req: Request) -> None:
        req.status = Status.RUNNING
        self.running.append(req)
        self.running.sort(key=Request.sort_key)

    def _assign_slot(self, req: Request) -> None:
        if self.free_slots:
            req.slot = self.free_slots.pop()
            self.slots[req.slot] = req
        else:
            req.slot = len(self.slots)
            self.slots.append(req)
        req.on_worker = True

    # -- results ------------------------------------------------------------------------------
    def update(self, result: pb.StepResult, outboxes: dict[bytes, Outbox]) -> list[Request]:
        """The result of the oldest plan in flight (results.py). Returns the sequences with news
        other than a plain token (first tokens, finishes)."""
        if not self.in_flight or result.step_id != self.in_flight[0].step_id:
            raise ValueError(f"result for step {result.step_id}, but the oldest plan in flight "
                             f"is {self.in_flight[0].step_id if self.in_flight else 'none'}")
        step = self.in_flight.popleft()
        self.last_result_at = time.monotonic()
        self.reuse_slots(step.step_id)
        if step.void:
            return []  # sent before a failed step came back; its sequences were requeued
        if step.alone:
            for req, _, _ in step.entries:
                req.suspect = False  # it ran alone and the worker survived it
        return apply_result(self, step, result, outboxes)

    def fail_oldest(self) -> list[Request]:
        """The worker failed the oldest plan (scheduler/failures.py): the sequences that failed
        alone, for the caller to end with INTERNAL. The others are requeued for recompute."""
        self.last_result_at = time.monotonic()
        return failures.fail_oldest(self)

    def reuse_slots(self, step_id: int) -> None:
        keep = []
        for sent, slot in self.released:
            if sent <= step_id:
                self.free_slots.append(slot)
            else:
                keep.append((sent, slot))
        self.released = keep

    # -- endings and preemption ---------------------------------------------------------------
    def finish(self, req: Request, reason: FinishReason) -> None:
        """Every way a sequence ends comes here, so its blocks are always freed at once."""
        if req.status is Status.FINISHED:
            return
        self.kv.free(req)
        self.drop_slot(req)
        if req in self.swapped:
            self.swapped.remove(req)
        if req.status is Status.WAITING:
            self.num_waiting -= 1
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.seq_id, None)

    def preempt(self, req: Request, step: Step) -> None:
        """Swap out to CPU when the cost model says moving the blocks twice beats computing the
        tokens again; else recompute: free the blocks and requeue. Freed blocks keep their
        hashes, so a recompute often finds most of its prefix still cached."""
        if req.beam is not None:
            return beam.preempt(self, req.beam, step)
        step.preempted = True
        req.num_preemptions += 1
        if not req.suspect and self.preemption.choose(req) == "swap":
            step.swap_out += self.kv.swap_out(req)
            self.drop_slot(req)
            req.status = Status.SWAPPED
            self.swapped.append(req)
        else:
            self.kv.free(req)
            self.drop_slot(req)
            req.num_computed_tokens = 0
            req.status = Status.WAITING
            self.num_waiting += 1
            self.enqueue(req)

    def drop_slot(self, req: Request) -> None:
        if req.on_worker:
            self.dropped.append(req.slot)
            self.slots[req.slot] = None
            self.released.append((self.step_id, req.slot))
            req.slot = -1
            req.on_worker = False

    def drain(self) -> list[Request]:
        """The worker is gone: hand back every unfinished sequence, reset to be recomputed (a
        beam search as its handle: it starts again from its prompt)."""
        for group in self.groups.values():
            group.handle.beam, group.handle.status = None, Status.WAITING
        out = sorted([r for r in self.requests.values() if r.beam is None] +
                     [g.handle for g in self.groups.values()], key=Request.sort_key)
        self.groups.clear()
        for req in out:
            self.kv.free(req)
            req.on_worker, req.slot = False, -1
            req.num_computed_tokens = req.num_pending = 0
            req.fork_children, req.fork_parent = [], None
            req.status = Status.WAITING
        self.requests.clear()
        self.num_waiting = 0
        self.waiting.clear()
        self.running.clear()
        self.swapped.clear()
        self.suspects.clear()
        self.in_flight.clear()
        self.dropped, self.slots, self.free_slots, self.released = [], [], [], []
        return out

    def tables(self) -> list[list[int]]:
        return [r.block_ids for r in self.requests.values()]

    @property
    def stats(self):
        return self.preemption.stats
