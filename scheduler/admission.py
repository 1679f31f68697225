"""How sequences enter the running batch, after the running ones have their tokens: swapped
sequences come back first, then waiting ones in priority order (reusing cached prefix blocks),
and the n > 1 children of a parent fork its blocks once its prompt is computed.

A mixin of Scheduler (scheduler/scheduler.py), whose state it works on: the pool, the queues,
the step's token budget and the list of sequences new to the worker this step.
"""
from __future__ import annotations

import heapq

from proto import internal_pb2 as pb
from scheduler.block_pool import full_block_hashes
from scheduler.request import Request, Status


class Admission:
    def _schedule_swapped(self) -> None:
        self.swapped.sort(key=Request.sort_key)
        while self.swapped and self.budget > 0 and self._room_for_one():
            req = self.swapped[0]
            n = self._chunk(req)
            need = self._blocks_needed(req, n)  # the swapped blocks plus room for n tokens
            if not self.pool.can_allocate(need):
                return
            self.swapped.pop(0)
            gpu = self.pool.allocate(len(req.cpu_block_ids))
            self._swap_in += [pb.BlockCopy(src=c, dst=g) for c, g in zip(req.cpu_block_ids, gpu)]
            self.preemption.cpu_pool.free(req.cpu_block_ids)
            req.cpu_block_ids = []
            req.block_ids = gpu
            req.status = Status.RUNNING
            self.running.append(req)
            self.running_sorted = False
            if n > 0:
                self._take(req, n)
            else:
                self._fork_now(req)

    def _schedule_waiting(self) -> None:
        while self.waiting and self.budget > 0 and self._room_for_one():
            req = self.waiting[0][-1]
            if req.status is not Status.WAITING:
                heapq.heappop(self.waiting)  # aborted while waiting
                continue
            n = self._admit(req)
            if n < 0:
                return  # strict priority order: nothing jumps the queue
            heapq.heappop(self.waiting)
            if n > 0:
                self._take(req, n)
            else:
                self._fork_now(req)

    def _fork_now(self, req: Request) -> None:
        """Fork a parent whose prompt is computed but for its last token, if the step has room;
        otherwise the running phase of a later step does it."""
        need = self._blocks_needed(req, 1) + len(req.fork_children)
        if 1 + len(req.fork_children) <= self.budget and self.pool.can_allocate(need):
            self.running += self._fork(req)
            self.running_sorted = False
            self._take(req, 1)

    def _room_for_one(self) -> bool:
        return len(self.running) < self.config.max_num_seqs

    def _chunk(self, req: Request) -> int:
        """Tokens to compute now. A parent with children waiting to fork stops one short of
        its prompt's end; only the running phase's fork computes that last token."""
        remaining = req.num_tokens - req.num_computed_tokens
        if req.fork_children:
            remaining -= 1
        return min(remaining, self.budget)

    def _blocks_needed(self, req: Request, n: int) -> int:
        total = -(-(req.num_computed_tokens + n) // self.block_size)
        return max(0, total - len(req.block_ids))

    def _take(self, req: Request, n: int) -> None:
        req.block_ids += self.pool.allocate(self._blocks_needed(req, n))
        self.scheduled.append((req, n))
        self.budget -= n

    def _admit(self, req: Request) -> int:
        """Take blocks for a waiting request, reusing cached prefix blocks. Returns the tokens
        to compute this step (0 when only a fork is pending), or -1 when it does not fit."""
        bs = self.block_size
        # A hit never covers the whole sequence: at least one token is computed, so logits exist.
        hashes = full_block_hashes(req.all_token_ids, bs, (req.num_tokens - 1) // bs)
        # Prompt logprobs need the logits of every prompt position: none may come from the cache.
        hits = [] if req.sampling.HasField("prompt_logprobs") else self.pool.find_cached(hashes)
        req.num_computed_tokens = len(hits) * bs
        n = self._chunk(req)  # 0 when only the fork is left: the next step does it
        need = -(-(req.num_computed_tokens + n) // bs) - len(hits)
        reviving = sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
        if not self.pool.can_allocate(need + reviving):
            req.num_computed_tokens = 0
            return -1
        self.pool.touch(hits)
        req.block_ids = hits
        req.block_hashes = hashes[:len(hits)]
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
            self.pool.queries += req.num_tokens
            self.pool.hits += req.num_computed_tokens
        req.status = Status.RUNNING
        self.num_waiting -= 1
        self.running.append(req)
        self.running_sorted = False
        return n

    def _fork(self, parent: Request) -> list[Request]:
        """The children share the parent's full blocks. The partly filled last block is about to
        be written by each of them, so each gets a copy through a copy operation in the plan."""
        bs, c = self.block_size, parent.num_computed_tokens
        full = c // bs
        for child in parent.fork_children:
            shared = parent.block_ids[:full]
            self.pool.touch(shared)
            own = self.pool.allocate(1)
            if c % bs:
                self._copy.append(pb.BlockCopy(src=parent.block_ids[full], dst=own[0]))
            child.block_ids = shared + own
            child.block_hashes = parent.block_hashes[:full]
            child.num_computed_tokens = c
            child.num_cached_tokens = parent.num_cached_tokens
            child.fork_parent = None
            child.status = Status.RUNNING
            self.num_waiting -= 1
            self.scheduled.append((child, 1))
            self.budget -= 1
        children, parent.fork_children = parent.fork_children, []
        return children
