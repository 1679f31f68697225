"""One worker's continuous-batching policy: which sequences compute how many tokens each step.

Each registered worker gets its own Scheduler and KVCacheManager; the router (router.py) decides
which worker a request goes to, this file everything after. A step has three phases, in this
order: running groups (preempting when blocks run out), then swapped ones coming back, then
waiting ones (reusing cached prefix blocks). It schedules sequence groups (sequence_group.py: a
plain request is a group of one) through their interface, and knows no kind of group.

One plan ahead: schedule() may run while the previous plan is still on the worker. A sequence's
computed count moves when it is scheduled, and a step that samples leaves a token "pending": the
worker feeds it into the next step itself, and the scheduler appends it when the result arrives
(results.py). Stops therefore lag one step; the token a finished sequence computes in the step
after is dropped.

A step the worker fails (fail_oldest): its sequences may be what breaks the worker, or its
innocent neighbours. Each group is recomputed and marked suspect, and a suspect runs alone until a
step with it succeeds, which clears it; one that fails alone is the cause and ends with INTERNAL.
A plan sent after the failed one counted on the failed step's sampled tokens and cache writes, so
it is void: its sequences are recomputed too (not suspect), and its result is dropped when it
comes back. Blocks those steps may have written leave the prefix cache.
"""
from __future__ import annotations

import time
from collections import deque
from operator import attrgetter

from proto import internal_pb2 as pb
from proto.speculation import may_speculate
from scheduler import progress
from scheduler.scheduler_config import SchedulerConfig
from scheduler.grammar_waits import GrammarWaits
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.preemption import PreemptionPolicy
from scheduler.queues import Queues
from scheduler.request import FinishReason, Request, Status
from scheduler.results import apply_result
from scheduler.sequence_group import SequenceGroup
from scheduler.speculation_stats import SpeculationStats
from scheduler.slots import Slots
from scheduler.step import Step
from scheduler.stream import Streams

_KEY = attrgetter("key")


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, first_step_id: int = 0,
                 streams: Streams | None = None) -> None:
        self.config, self.streams = config, Streams() if streams is None else streams
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 config.num_cpu_blocks)
        self.preemption = PreemptionPolicy(config, self.kv)
        # What the worker's proposals came to, every position counted from the start.
        self.speculation = SpeculationStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self.queues = Queues()
        self.grammars = GrammarWaits()  # groups not ready until their grammar is compiled
        self.slots = Slots()
        self.in_flight: deque[Step] = deque()  # plans sent, results not yet back
        self.last_result_at = 0.0  # monotonic: the worker starts the next plan in flight then
        # From the router's epoch: a result of an earlier registration never matches a plan.
        self.step_id = first_step_id

    # -- what the router and reports read -----------------------------------------------------
    @property
    def requests(self) -> dict[str, Request]:
        """Every unfinished sequence here, by seq_id (read only: the queues own it)."""
        return self.queues.requests

    @property
    def groups(self) -> dict[str, SequenceGroup]:
        return self.queues.groups

    @property
    def num_waiting(self) -> int:
        return self.queues.num_waiting

    @property
    def running(self) -> list[Request]:
        return [seq for group in self.queues.running for seq in group.seqs()
                if seq.status is Status.RUNNING]

    @property
    def swapped(self) -> list[Request]:
        return [group.handle for group in self.queues.swapped]

    @property
    def suspects(self) -> list[Request]:
        return [group.handle for group in self.queues.suspects]

    @property
    def waiting(self) -> list[Request]:
        return [entry[-1].handle for entry in self.queues.waiting]

    @property
    def running_step(self) -> Step | None:
        """The plan the worker is running: the oldest in flight."""
        return self.in_flight[0] if self.in_flight else None

    @property
    def stats(self):
        return self.preemption.stats

    @property
    def has_work(self) -> bool:
        return bool(self.queues.requests) or bool(self.slots.dropped)

    @property
    def can_plan(self) -> bool:
        if len(self.in_flight) >= self.config.max_plans_in_flight:
            return False
        if not self.in_flight or not self.config.num_speculative_tokens:
            return True
        # Speculation and the plan ahead: a plan built before the last result is back cannot
        # know how many tokens that result brings, so none follows a plan that speculates, and
        # none goes ahead while a sequence would propose in the next one (docs/design.md).
        return not self.in_flight[-1].spec_slots and not self._would_speculate()

    @property
    def speculates(self) -> bool:
        """Whether this step may carry proposals: speculation is on and the batch is small enough."""
        cfg = self.config
        return bool(cfg.num_speculative_tokens) and not (
            cfg.spec_disable_by_batch_size and self.queues.num_running > cfg.spec_disable_by_batch_size)

    def _would_speculate(self) -> bool:
        if not self.speculates:
            return False
        paced = self.config.spec_paced_by_worker  # no back-off: every decode may propose
        return any(paced or seq.draft is None or seq.draft.ready for group in self.queues.running
                   for seq in group.seqs() if seq.status is Status.RUNNING
                   and may_speculate(seq.sampling))

    def tables(self) -> list[list[int]]:
        return [r.block_ids for r in self.queues.requests.values()]

    # -- intake -------------------------------------------------------------------------------
    def add(self, group: SequenceGroup, ready: bool = True) -> None:
        """A request arrives, as a group. One not ready waits apart, never admitted, until
        mark_ready; one with a grammar is not ready until the worker has compiled it."""
        group.start(self)
        self.queues.track(group)
        handle = group.handle
        self.queues.enqueue(group, ready and not self.grammars.need(handle.seq_id, handle.sampling))

    def grammar_requests(self) -> list[pb.CompileGrammars]:
        """The grammars to ask the worker for, once each (nothing, most of the time)."""
        return self.grammars.take_requests()

    def grammars_compiled(self, msg: pb.GrammarsCompiled) -> list[tuple[Request, str]]:
        """The worker's answer: the groups whose grammar is ready may run; those whose grammar
        does not compile end (returned with the reason, for the router to tell their clients)."""
        ready, failed = self.grammars.compiled(msg)
        for seq_id in ready:
            self.mark_ready(seq_id)
        ended = []
        for seq_id, why in failed:
            group = self.queues.groups.get(seq_id)
            for seq in (group.seqs() if group is not None else []):
                self.finish(seq, FinishReason.ERROR)
                ended.append((seq, f"structured_output does not compile: {why}"))
        return ended

    def add_sequence(self, seq: Request) -> None:
        """A sequence new to this worker (its group's start): its stop rule, and it waits."""
        seq.set_limits(self.config.eos_token_ids, self.config.max_model_len)
        self.queues.add(seq)

    def mark_ready(self, seq_id: str) -> None:
        """The group known by seq_id may be admitted from now on."""
        group = self.queues.groups.get(seq_id)
        if group is not None:
            self.queues.mark_ready(group)

    def abort(self, seq_id: str) -> Request | None:
        req = self.queues.requests.get(seq_id)
        if req is not None:
            self.finish(req, FinishReason.ABORT)
            return req
        group = self.queues.groups.get(seq_id)  # known by a handle outside the batch
        if group is not None:
            group.end(self, FinishReason.ABORT)
            return group.handle
        return None

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> pb.StepPlan | None:
        step = Step(self.step_id + 1, self.config.max_num_batched_tokens,
                    self.config.num_speculative_tokens if self.speculates else 0,
                    self.config.spec_paced_by_worker)
        queues = self.queues
        queues.prune()
        if queues.suspects:
            if self.in_flight:
                return None  # a suspect's step runs alone: let the pipeline drain first
            if self._schedule_alone(step):
                step.dropped = self.slots.take_dropped()
                return self._send(step)
        self._schedule_running(step)
        # A step that had to preempt admits nothing: the victims would come straight back.
        if not step.preempted:
            self._schedule_swapped(step)
            if not queues.swapped:  # swapped groups resume before any new one is admitted
                self._schedule_waiting(step)
        step.dropped = self.slots.take_dropped()
        if step.is_empty():
            self.slots.give_back(step.dropped)
            return None
        return self._send(step)

    def _send(self, step: Step) -> pb.StepPlan:
        if step.forked:  # they joined this step already; no phase above may schedule them again
            self.queues.start_running(*step.forked)
        self.step_id += 1
        now = time.monotonic() if step.new else 0.0
        for req, _ in step.new:
            if req.queue_time < 0:
                req.queue_time = now - req.arrival_time
            self.slots.assign(req)
        plan = step.plan()
        step.sent_at = time.monotonic()
        self.in_flight.append(step)
        return plan

    def _schedule_running(self, step: Step) -> None:
        """The next tokens, or the next prefill chunks, of every running group."""
        for group in self.queues.running:  # preemption and forks leave the list itself alone
            if step.budget == 0:
                break
            group.schedule(self, step)

    def _schedule_swapped(self, step: Step) -> None:
        queues = self.queues
        while queues.swapped and step.budget > 0:
            group = queues.swapped[0]
            if not self.has_room(group.seats, step) or not group.resume(self, step):
                return

    def _schedule_waiting(self, step: Step) -> None:
        queues = self.queues
        while step.budget > 0:
            group = queues.next_waiting()
            # Strict priority order: nothing jumps the queue.
            if group is None or not self.has_room(group.seats, step) or not group.admit(self, step):
                return
            queues.pop_waiting()

    def _schedule_alone(self, step: Step) -> bool:
        """Put the first suspect that fits into `step`, alone. False: none fits now (no blocks or
        no room); the caller plans a step of the others. Every suspect here waits: one runs only
        in its own step, which clears it when it succeeds and requeues or ends it when it fails."""
        for group in sorted(self.queues.suspects, key=_KEY):
            if group.handle.status is Status.WAITING and self.has_room(group.seats, step) \
                    and group.admit(self, step):
                step.alone = True
                return True
        return False

    def has_room(self, seats: int, step: Step) -> bool:
        """Whether `seats` more sequences fit under max_num_seqs in this step, keeping the room
        the running groups may still fork into."""
        queues = self.queues
        return queues.num_running + len(step.forked) + seats + queues.reserved() \
            <= self.config.max_num_seqs

    def preempt_for(self, group: SequenceGroup, step: Step) -> bool:
        """Preempt the lowest-priority, latest-arrived running group (the list is in that order).
        Returns False once `group` itself was it."""
        victim = next(g for g in reversed(self.queues.running) if g.handle.status is Status.RUNNING)
        victim.preempt(self, step)
        return victim is not group

    # -- results ------------------------------------------------------------------------------
    def update(self, result: pb.StepResult) -> list[Request]:
        """The result of the oldest plan in flight (results.py). Returns the sequences, or the
        handles of groups, that ended in it."""
        if not self.in_flight or result.step_id != self.in_flight[0].step_id:
            raise ValueError(f"result for step {result.step_id}, but the oldest plan in flight "
                             f"is {self.in_flight[0].step_id if self.in_flight else 'none'}")
        step = self.in_flight.popleft()
        self.last_result_at = time.monotonic()
        self.slots.reuse(step.step_id)
        if step.void:
            return []  # sent before a failed step came back; its sequences were requeued
        if step.alone:
            for req, _, _ in step.entries:
                req.group.suspect = False  # it ran alone and the worker survived it
        return apply_result(self, step, result)

    def failed_rows(self, result: pb.StepResult) -> list[tuple[Request, str]]:
        """The sequences the worker could not go on with (their grammar left no token: a
        conflict of the request's own settings) and why; the caller ends each with
        INVALID_ARGUMENT. Read before update(), while the result's slots still name them."""
        table = self.slots.table
        out = []
        for f in result.failed:
            req = table[f.slot] if f.slot < len(table) else None
            if req is not None and req.status is not Status.FINISHED:
                out.append((req, f.reason))
        return out

    def fail_oldest(self) -> list[Request]:
        """The worker failed the oldest plan in flight. Returns the handles of the groups that
        failed alone, for the caller to end with INTERNAL; every other group of that plan and of
        the void plans after it is requeued for recompute."""
        self.last_result_at = time.monotonic()
        step = self.in_flight.popleft()
        self.slots.reuse(step.step_id)
        for later in self.in_flight:
            later.void = True
        failed = _live(step.entries)
        failed_ids = {id(r) for r in failed}
        later_seqs = _live(e for s in self.in_flight for e in s.entries)
        in_flight_tokens: dict[int, int] = {}
        for s in (step, *self.in_flight):
            for req, n, _ in s.entries:
                in_flight_tokens[id(req)] = in_flight_tokens.get(id(req), 0) + n
        by_group: dict[int, tuple[SequenceGroup, list[Request]]] = {}
        for req in failed + [r for r in later_seqs if id(r) not in failed_ids]:
            by_group.setdefault(id(req.group), (req.group, []))[1].append(req)
        culprits = []
        # Groups that may fork (beam searches) go back after the others: the order decides which
        # freed blocks are reused first, and this one keeps the plans as they were before groups.
        for group, seqs in sorted(by_group.values(), key=lambda entry: entry[0].grows):
            for req in seqs:
                # The failed and void steps wrote (or not) the positions after this one; a block
                # cached one step early (its last token's KV still in flight) must not be found.
                self.kv.uncache_from(req, max(0, req.num_tokens - in_flight_tokens[id(req)] - 1))
            culprit = group.fail(self, [r for r in seqs if id(r) in failed_ids], step.alone)
            if culprit is not None:
                culprits.append(culprit)
                continue
            for seq in group.seqs():  # what the failed and void plans were to sample never comes
                progress.reset(seq)
        return culprits

    # -- endings and preemption ---------------------------------------------------------------
    def finish(self, seq: Request, reason: FinishReason) -> None:
        """Every way a sequence ends comes here, so its blocks are always freed at once."""
        if seq.status is Status.FINISHED:
            return
        self.kv.free(seq)
        self.drop_slot(seq)
        self.queues.remove(seq)
        seq.finish_reason = reason

    def recompute(self, group: SequenceGroup, seqs: list[Request]) -> None:
        """`seqs`, the group's, leave the batch to be computed again from their first token:
        their blocks and slots go, and the group waits in line (Queues.recompute). Freed blocks
        keep their hashes, so the recompute often finds most of its prefix still cached."""
        for seq in seqs:
            if seq.status is Status.RUNNING or seq.status is Status.SWAPPED:
                self.kv.free(seq)
                self.drop_slot(seq)
            progress.restart(seq)
        self.queues.recompute(group, seqs)

    def swap_out(self, group: SequenceGroup, seq: Request, step: Step) -> None:
        """seq's blocks go to CPU in `step` and its group waits in the swapped list."""
        step.swap_out += self.kv.swap_out(seq)
        self.drop_slot(seq)
        self.queues.swap_out(group, seq)

    def swap_in(self, group: SequenceGroup, seq: Request, n: int, step: Step) -> bool:
        """seq's blocks come back from CPU in `step`, with room for n more tokens, and its group
        runs again; False: no room now."""
        moves = self.kv.swap_in(seq, n)
        if moves is None:
            return False
        step.swap_in += moves
        self.queues.admit(group, (seq,))
        return True

    def drop_slot(self, seq: Request) -> None:
        self.slots.release(seq, self.step_id)

    def drain(self) -> list[Request]:
        """The worker is gone: hand back every unfinished request, reset to be recomputed (a beam
        search as its handle: it starts again from its prompt)."""
        groups = {id(s.group): s.group for s in self.queues.requests.values()}
        out = sorted((r for g in groups.values() for r in g.drained()), key=Request.sort_key)
        for req in out:
            self.kv.free(req)
            req.on_worker, req.slot = False, -1
            progress.reset(req)
            req.status = Status.WAITING  # for the router: it waits for a worker
        self.queues.clear()
        self.slots.clear()
        self.in_flight.clear()
        return out


def _live(entries) -> list[Request]:
    """The unfinished sequences of step entries, each once, in order."""
    seen: dict[int, Request] = {}
    for req, _, _ in entries:
        if req.status is not Status.FINISHED:
            seen.setdefault(id(req), req)
    return list(seen.values())
