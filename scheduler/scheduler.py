"""One worker's continuous-batching policy: which sequences compute how many tokens this step.

Each registered worker gets its own Scheduler and BlockPool. The router (scheduler/router.py)
decides which worker a request goes to; this file decides everything after that. A step has
three phases, in this order: running sequences (preempting when blocks run out; quiet steps run
on numpy columns, scheduler/columns.py), then swapped sequences coming back and waiting ones
(scheduler/admission.py).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import time
from dataclasses import dataclass

from proto import internal_pb2 as pb
from proto.columns import pack
from scheduler.admission import Admission
from scheduler.block_pool import BlockPool
from scheduler.columns import RunningColumns
from scheduler.outbox import Outbox
from scheduler.preemption import PreemptionPolicy
from scheduler.request import FinishReason, Request, Status
from scheduler.results import apply_result

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


class Scheduler(Admission):
    def __init__(self, config: SchedulerConfig, num_blocks: int) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.preemption = PreemptionPolicy(config)
        self.waiting: list[tuple[int, int, int, Request]] = []  # heap: priority, arrival, tiebreak
        self._tiebreak = itertools.count()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}              # every unfinished sequence here
        self.num_waiting = 0  # of those, the ones in status WAITING (fork children included)
        self.dropped: list[int] = []                         # slots the worker must forget
        self.slots: list[Request | None] = []                # slot -> sequence on the worker
        self.free_slots: list[int] = []
        self.running_sorted = True
        self.running_dirty = False  # finished or preempted sequences still in self.running
        self.in_flight: list[tuple[Request, int, int]] = []  # (sequence, tokens, slot), plan order
        # Quiet steps run on numpy columns (scheduler/columns.py): those for the next step, and
        # those of the plan now running, whose sequences follow `in_flight` in the plan.
        self.cols: RunningColumns | None = None
        self.flight_cols: RunningColumns | None = None
        self._cols_retry = 0  # steps to wait before building columns again after a fallback
        self.num_running_ended = 0  # finishes of running sequences: did one hit the plan in flight?
        self.flight_ended = 0
        self.step_id = 0
        # Cache operations for the next plan: device -> cpu, cpu -> device, copy-on-write.
        self._swap_out, self._swap_in, self._copy = [], [], []

    # -- intake -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
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
            heapq.heappush(self.waiting, (req.priority, req.arrival, next(self._tiebreak), req))
        # A fork child waits, off the queue, for its parent to compute the prompt.

    def abort(self, seq_id: str) -> Request | None:
        req = self.requests.get(seq_id)
        if req is not None:
            self.finish(req, FinishReason.ABORT)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> pb.StepPlan | None:
        assert not self.in_flight and not self.flight_cols, "one plan at a time per worker"
        self.budget = self.config.max_num_batched_tokens
        self.scheduled: list[tuple[Request, int]] = []  # sequences new to the worker
        # The running sequences' columns of the plan, filled by _schedule_running.
        self.run_entries: list[tuple[Request, int, int]] = []
        self.run_slots, self.run_tokens, self.block_slots, self.block_ids = [], [], [], []
        preempted = self._schedule_running()
        # A step that had to preempt admits nothing: the victims would come straight back.
        if not preempted:
            self._schedule_swapped()
            if not self.swapped:  # swapped sequences resume before any new one is admitted
                self._schedule_waiting()
        if not self.scheduled and not self.run_entries and not self.flight_cols and not self.dropped:
            return None
        return self._build_plan()

    def _schedule_running(self) -> bool:
        """One decode token, or the next prefill chunk, for every running sequence. This loop
        runs for every sequence every step, so the plain decode case is kept lean."""
        preempted, forked = False, []
        RUNNING = Status.RUNNING
        changed = self.running_dirty or not self.running_sorted
        if self.running_dirty:
            self.running = [r for r in self.running if r.status is RUNNING]
            self.running_dirty = False
        if not self.running_sorted:
            self.running.sort(key=Request.sort_key)
            self.running_sorted = True
        if changed:
            self.cols = None
        elif self.cols is None:  # a quiet step: the next ones may be quiet too
            self._cols_retry -= 1
            if self._cols_retry < 0:
                self.cols = RunningColumns.build(self.running, self.block_size)
        if self.cols is not None:
            if self.cols.schedule(self):
                self.flight_cols = self.cols  # the plan's running part, until its result is back
                return False
            self.cols, self._cols_retry = None, 8
        running = self.running
        bs, pool, budget = self.block_size, self.pool, self.budget
        run_entries, run_slots, run_tokens = self.run_entries, self.run_slots, self.run_tokens
        block_slots, block_ids = self.block_slots, self.block_ids
        for req in running:
            if budget == 0:
                break
            if req.status is not RUNNING:
                continue  # a victim earlier in this loop
            n = len(req.all_token_ids) - req.num_computed_tokens
            forking = bool(req.fork_children)
            if forking:
                if n > 1:
                    n, forking = n - 1, False  # the children fork at the prompt's last token
                elif 1 + len(req.fork_children) > budget:
                    continue  # the fork needs one token per child; wait for a roomier step
            if n > budget:
                n = budget
            need = (req.num_computed_tokens + n + bs - 1) // bs - len(req.block_ids)
            if forking:
                need += len(req.fork_children)
            while need > 0 and not pool.can_allocate(need):
                # The lowest-priority, latest-arrived sequence not yet given work this step: the
                # list is in that order, so the scan from the end stops at `req` at the latest.
                victim = next(r for r in reversed(running) if r.status is RUNNING)
                self.preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RUNNING:
                continue
            if forking:
                self.budget = budget
                children = self._fork(req)
                budget = self.budget
                forked += children
                need -= len(children)  # _fork took the children's blocks itself
            if not req.on_worker:
                # Admitted with nothing to compute (a fork was pending): new to the worker.
                if need > 0:
                    req.block_ids += pool.allocate(need)
                self.scheduled.append((req, n))
                budget -= n
                continue
            # A sequence the worker holds goes straight into the plan's columns, which spares
            # this hot loop a second pass in _build_plan.
            slot = req.slot
            if need > 0:
                blocks = pool.allocate(need)
                req.block_ids += blocks
                block_slots += [slot] * need
                block_ids += blocks
            run_entries.append((req, n, slot))
            run_slots.append(slot)
            run_tokens.append(n)
            budget -= n
        self.budget = budget
        if forked:
            self.running += forked
            self.running_sorted = False
        return preempted

    def _build_plan(self) -> pb.StepPlan:
        self.step_id += 1
        plan = pb.StepPlan(step_id=self.step_id, dropped_slots=self.dropped,
                           swap_out=self._swap_out, swap_in=self._swap_in, copy=self._copy)
        self.dropped, self._swap_out, self._swap_in, self._copy = [], [], [], []
        new_entries = []  # (sequence, tokens, slot), in the plan's order like run_entries
        now = time.monotonic() if self.scheduled else 0.0
        for req, n in self.scheduled:
            if req.queue_time < 0:
                req.queue_time = now - req.arrival_time
            self._assign_slot(req)
            new_entries.append((req, n, req.slot))
            plan.new_seqs.append(pb.NewSeq(
                seq_id=req.seq_id, slot=req.slot, token_ids=req.all_token_ids,
                sampling=req.sampling, num_computed_tokens=req.num_computed_tokens,
                block_ids=req.block_ids, num_new_tokens=n,
                num_prompt_tokens=req.num_prompt_tokens))
        if self.flight_cols is not None:
            plan.running_slots = self.flight_cols.slots_column
            plan.running_num_tokens = pack(self.flight_cols.n)
        else:
            plan.running_slots = pack(self.run_slots)
            plan.running_num_tokens = pack(self.run_tokens)
        plan.new_block_slots = pack(self.block_slots)
        plan.new_block_ids = pack(self.block_ids)
        self.in_flight, self.scheduled = new_entries + self.run_entries, []
        self.flight_ended = self.num_running_ended
        return plan

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
        """See scheduler/results.py: advance, append, stop and stream. Returns the sequences
        with news other than a plain token (first tokens, finishes)."""
        return apply_result(self, result, outboxes)

    # -- endings and preemption ---------------------------------------------------------------
    def finish(self, req: Request, reason: FinishReason) -> None:
        """Every way a sequence ends comes here, so its blocks are always freed at once."""
        if req.status is Status.FINISHED:
            return
        self._release(req)
        if req.cpu_block_ids:
            self.preemption.cpu_pool.free(req.cpu_block_ids)
            req.cpu_block_ids = []
        if req in self.swapped:
            self.swapped.remove(req)
        if req.status is Status.RUNNING:
            self.running_dirty = True
            self.num_running_ended += 1
        if req.status is Status.WAITING:
            self.num_waiting -= 1
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.seq_id, None)

    def preempt(self, req: Request) -> None:
        """Swap out to CPU when the cost model says moving the blocks twice beats computing the
        tokens again; else recompute: free the blocks and requeue. Freed blocks keep their
        hashes, so a recompute often finds most of its prefix still cached."""
        mode = self.preemption.choose(req)
        req.num_preemptions += 1
        self.running_dirty = True
        if mode == "swap":
            cpu = self.preemption.cpu_pool.allocate(len(req.block_ids))
            self._swap_out += [pb.BlockCopy(src=g, dst=c) for g, c in zip(req.block_ids, cpu)]
            self._release(req)
            req.cpu_block_ids = cpu
            req.status = Status.SWAPPED
            self.swapped.append(req)
        else:
            self._release(req)
            req.num_computed_tokens = 0
            req.block_hashes = []
            req.status = Status.WAITING
            self.num_waiting += 1
            heapq.heappush(self.waiting, (req.priority, req.arrival, next(self._tiebreak), req))

    def _release(self, req: Request) -> None:
        if req.block_ids:
            self.pool.free(req.block_ids)
            req.block_ids = []
        if req.on_worker:
            self.dropped.append(req.slot)
            self.slots[req.slot] = None
            self.free_slots.append(req.slot)
            req.slot = -1
            req.on_worker = False

    def drain(self) -> list[Request]:
        """The worker is gone: hand back every unfinished sequence, reset to be recomputed."""
        out = sorted(self.requests.values(), key=Request.sort_key)
        for req in out:
            self._release(req)
            if req.cpu_block_ids:
                self.preemption.cpu_pool.free(req.cpu_block_ids)
                req.cpu_block_ids = []
            req.num_computed_tokens = 0
            req.block_hashes = []
            req.fork_children, req.fork_parent = [], None
            req.status = Status.WAITING
        self.requests.clear()
        self.num_waiting = 0
        self.waiting.clear()
        self.running.clear()
        self.swapped.clear()
        self.in_flight, self.flight_cols, self.cols = [], None, None
        self.dropped = []
        self.slots, self.free_slots = [], []
        return out

    def take_in_flight(self) -> list[Request]:
        """The sequences of the plan now running, which is given up (its worker failed it)."""
        out = [req for req, _, _ in self.in_flight]
        if self.flight_cols is not None:
            out += self.flight_cols.reqs
        self.in_flight, self.flight_cols = [], None
        return out

    def tables(self) -> list[list[int]]:
        return [r.block_ids for r in self.requests.values()]

    @property
    def stats(self):
        return self.preemption.stats
