"""One worker's continuous-batching policy: which sequences compute how many tokens this step.

Each registered worker gets its own Scheduler and BlockPool. The router (scheduler/router.py)
decides which worker a request goes to; this file decides everything after that.
"""
from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field

from proto import internal_pb2 as pb
from scheduler.block_pool import BlockPool, hash_block
from scheduler.request import FinishReason, Request, Status

log = logging.getLogger("pagoda.scheduler")


@dataclass
class SchedulerConfig:
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    eos_token_ids: frozenset[int] = frozenset()


@dataclass
class StepStats:
    num_preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.waiting: list[tuple[int, int, Request]] = []   # heap of (priority, arrival, request)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}              # every unfinished sequence here
        self.dropped: list[str] = []                         # to tell the worker to forget
        self.in_flight: list[tuple[Request, int]] = []       # (sequence, tokens) of the sent plan
        self.step_id = 0
        self.stats = StepStats()

    # -- intake -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.requests[req.seq_id] = req
        heapq.heappush(self.waiting, (req.priority, req.arrival, req))

    def abort(self, seq_id: str) -> Request | None:
        req = self.requests.get(seq_id)
        if req is not None:
            self.finish(req, FinishReason.ABORT)
        return req

    @property
    def num_waiting(self) -> int:
        return sum(1 for r in self.requests.values() if r.status is Status.WAITING)

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> pb.StepPlan | None:
        """Running sequences first (one decode token, or the next chunk of a prefill), then
        waiting ones in priority order for as long as blocks and the token budget last."""
        assert not self.in_flight, "one plan at a time per worker"
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False

        self.running = [r for r in self.running if r.status is Status.RUNNING]
        self.running.sort(key=Request.sort_key)
        for req in self.running:
            if budget == 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            need = self._blocks_needed(req, n)
            while not self.pool.can_allocate(need):
                victim = max((r for r in self.running if r.status is Status.RUNNING),
                             key=Request.sort_key)
                self.preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            req.block_ids += self.pool.allocate(need)
            scheduled.append((req, n))
            budget -= n
        self.running = [r for r in self.running if r.status is Status.RUNNING]

        # A step that had to preempt admits nothing new: the victims would come straight back.
        while self.waiting and not preempted and budget > 0 \
                and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0][2]
            if req.status is not Status.WAITING:
                heapq.heappop(self.waiting)  # aborted while waiting
                continue
            n = self._admit(req, budget)
            if n == 0:
                break  # strict priority order: nothing jumps the queue
            heapq.heappop(self.waiting)
            scheduled.append((req, n))
            budget -= n

        if not scheduled and not self.dropped:
            return None
        return self._build_plan(scheduled)

    def _blocks_needed(self, req: Request, n: int) -> int:
        total = -(-(req.num_computed_tokens + n) // self.block_size)
        return max(0, total - len(req.block_ids))

    def _admit(self, req: Request, budget: int) -> int:
        """Take blocks for a waiting request's first chunk, reusing cached prefix blocks.
        Returns the number of tokens scheduled, 0 when it does not fit."""
        bs = self.block_size
        # A hit never covers the whole sequence: at least one token is computed, so logits exist.
        hashes = self._full_block_hashes(req, (req.num_tokens - 1) // bs)
        hits = self.pool.find_cached(hashes)
        num_computed = len(hits) * bs
        n = min(req.num_tokens - num_computed, budget)
        need = -(-(num_computed + n) // bs) - len(hits)
        reviving = sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
        if not self.pool.can_allocate(need + reviving):
            return 0
        self.pool.touch(hits)
        req.block_ids = hits + self.pool.allocate(need)
        req.block_hashes = hashes[:len(hits)]
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_computed
            self.pool.queries += req.num_tokens
            self.pool.hits += num_computed
        req.status = Status.RUNNING
        self.running.append(req)
        return n

    def _full_block_hashes(self, req: Request, num_blocks: int) -> list[int]:
        bs, out, parent = self.block_size, [], None
        tokens = req.all_token_ids
        for i in range(num_blocks):
            parent = hash_block(parent, tokens[i * bs:(i + 1) * bs])
            out.append(parent)
        return out

    def _build_plan(self, scheduled: list[tuple[Request, int]]) -> pb.StepPlan:
        self.step_id += 1
        plan = pb.StepPlan(step_id=self.step_id, dropped_seq_ids=self.dropped)
        self.dropped = []
        for req, n in scheduled:
            if req.on_worker:
                plan.running_seqs.append(pb.RunningSeq(
                    seq_id=req.seq_id, new_block_ids=req.block_ids[req.num_blocks_sent:],
                    num_new_tokens=n))
            else:
                plan.new_seqs.append(pb.NewSeq(
                    seq_id=req.seq_id, token_ids=req.all_token_ids, sampling=req.sampling,
                    num_computed_tokens=req.num_computed_tokens, block_ids=req.block_ids,
                    num_new_tokens=n))
                req.on_worker = True
            req.num_blocks_sent = len(req.block_ids)
        self.in_flight = scheduled
        return plan

    # -- results ------------------------------------------------------------------------------
    def update(self, result: pb.StepResult) -> list[Request]:
        """Advance the sent plan's sequences, append sampled tokens, check stops.
        Returns the sequences with something new for their gateway."""
        bs = self.block_size
        for req, n in self.in_flight:
            if req.status is not Status.RUNNING:
                continue  # aborted or preempted while the plan ran
            req.num_computed_tokens += n
            full = req.num_computed_tokens // bs
            if self.pool.enable_prefix_caching and full > len(req.block_hashes):
                parent = req.block_hashes[-1] if req.block_hashes else None
                for i in range(len(req.block_hashes), full):
                    parent = hash_block(parent, req.all_token_ids[i * bs:(i + 1) * bs])
                    req.block_hashes.append(parent)
                    self.pool.cache_block(req.block_ids[i], parent)
        self.in_flight = []

        touched = []
        for seq_id, token in zip(result.seq_ids, result.token_ids):
            req = self.requests.get(seq_id)
            if req is None or req.status is not Status.RUNNING:
                continue
            req.append_token(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish(req, reason)
            touched.append(req)
        return touched

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        if not req.ignore_eos and token in self.config.eos_token_ids:
            return FinishReason.STOP
        if token in req.stop_token_ids:
            return FinishReason.STOP
        if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    # -- endings ------------------------------------------------------------------------------
    def finish(self, req: Request, reason: FinishReason) -> None:
        """Every way a sequence ends comes here, so its blocks are always freed at once."""
        if req.status is Status.FINISHED:
            return
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.seq_id, None)

    def preempt(self, req: Request) -> None:
        """Recompute preemption: free the blocks and requeue. Freed blocks keep their hashes, so
        the recompute often finds most of its prefix still cached."""
        self._release(req)
        req.num_computed_tokens = 0
        req.block_hashes = []
        req.num_preemptions += 1
        req.status = Status.WAITING
        heapq.heappush(self.waiting, (req.priority, req.arrival, req))
        self.stats.num_preemptions["recompute"] += 1
        log.info("preempt %s by recompute (%d tokens)", req.seq_id, req.num_tokens)

    def _release(self, req: Request) -> None:
        if req.block_ids:
            self.pool.free(req.block_ids)
            req.block_ids = []
        req.num_blocks_sent = 0
        if req.on_worker:
            self.dropped.append(req.seq_id)
            req.on_worker = False

    def drain(self) -> list[Request]:
        """The worker is gone: hand back every unfinished sequence, reset to be recomputed."""
        out = sorted(self.requests.values(), key=Request.sort_key)
        for req in out:
            self._release(req)
            req.num_computed_tokens = 0
            req.block_hashes = []
            req.status = Status.WAITING
        self.requests.clear()
        self.waiting.clear()
        self.running.clear()
        self.in_flight = []
        self.dropped = []
        return out

    def tables(self) -> list[list[int]]:
        return [r.block_ids for r in self.requests.values()]
