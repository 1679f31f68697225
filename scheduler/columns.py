"""The running sequences as numpy columns, for the steps in which nothing happens but decoding.

At high load most steps are quiet: no sequence arrives, ends, forks or is preempted, and every
sequence does the same arithmetic (a token more, a block every block_size tokens). Such a step
costs the per-sequence loops of scheduler.py and results.py about 2 us per sequence. Here it
costs a few numpy operations and one short loop that keeps each Request current.

The Request objects stay the truth. The columns are built from them after a quiet step, are
dropped whenever the running list changes, and anything unusual (a budget or block shortfall, a
fork, an abort while the plan runs) falls back to the per-sequence path.
"""
from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from proto.columns import pack
from scheduler.outbox import Outbox
from scheduler.request import FinishReason, Request, Status
from scheduler.results import cache_full_blocks

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


class RunningColumns:
    """Mirrors `reqs` (the scheduler's running list, in its order) position by position."""

    def __init__(self, reqs: list[Request], block_size: int) -> None:
        self.reqs = list(reqs)
        self.block_size = block_size
        # One pass over the sequences, then one column per field: this runs after every step
        # that changed the running list, so it must cost much less than the step it speeds up.
        rows = [(r.slot, r.num_computed_tokens, len(r.all_token_ids), len(r.block_ids),
                 len(r.block_hashes), r.length_limit, r.index,
                 # Whether every token so far has been streamed, so the next one goes out as a
                 # plain column entry (a first token carries usage and goes through the router).
                 r.stream_started and not r.num_unstreamed) for r in reqs]
        table = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=8 * len(rows))
        (self.slots, self.computed, self.num_tokens, self.num_blocks, self.num_hashed, self.limit,
         indices, streaming) = table.reshape(len(rows), 8).T.copy()
        self.slots_column = pack(self.slots)
        self.indices = indices.astype(np.int32)  # as the column packs it
        self.streaming = streaming.astype(bool)
        stops = {t for r in reqs for t in r.stop_set}
        self.stop_tokens = np.array(sorted(stops), dtype=np.int64)
        self.request_ids = [r.request_id for r in reqs]
        gws = [r.gateway for r in reqs]
        self.gateways: dict[bytes, np.ndarray] = {}
        for gw in set(gws):
            self.gateways[gw] = np.array([g == gw for g in gws], dtype=bool)
        self.n: np.ndarray | None = None  # tokens per position in the plan now running

    @classmethod
    def build(cls, running: list[Request], block_size: int) -> "RunningColumns | None":
        """Columns for a running list the fast path can serve, or None."""
        if not running or any(not r.on_worker or r.fork_children for r in running):
            return None
        return cls(running, block_size)

    # -- schedule -----------------------------------------------------------------------------
    def schedule(self, sched: "Scheduler") -> bool:
        """Give every sequence its remaining tokens and the blocks they need, or return False
        (and change nothing) when the budget or the free blocks do not cover all of them."""
        n = self.num_tokens - self.computed
        total = int(n.sum())
        if total > sched.budget:
            return False
        need = (self.computed + n + (self.block_size - 1)) // self.block_size - self.num_blocks
        grow = np.flatnonzero(need > 0)
        counts = need[grow]
        wanted = int(counts.sum())
        if wanted > sched.pool.num_free:
            return False
        if wanted:
            blocks = sched.pool.allocate(wanted)
            start = 0
            for i, k in zip(grow.tolist(), counts.tolist()):
                self.reqs[i].block_ids += blocks[start:start + k]
                start += k
            self.num_blocks[grow] += counts
            sched.block_slots = np.repeat(self.slots[grow], counts)
            sched.block_ids = blocks
        sched.budget -= total
        self.n = n
        return True

    # -- results ------------------------------------------------------------------------------
    def apply(self, sched: "Scheduler", slots: np.ndarray, tokens: np.ndarray,
              outboxes: dict[bytes, Outbox], others: list[Request]) -> None:
        """The result's part for these sequences, which must all still be running."""
        reqs, n = self.reqs, self.n
        computed = self.computed + n
        pos = np.flatnonzero(computed == self.num_tokens)  # the positions that sampled
        if len(slots) != len(pos) or not np.array_equal(slots, self.slots[pos]):
            raise ValueError(f"step {sched.step_id}: the sampled slots differ from the plan's")
        self.computed = computed
        toks = tokens.tolist()
        if len(pos) == len(reqs):  # the usual step: every sequence sampled
            for req, c, t in zip(reqs, computed.tolist(), toks):
                req.num_computed_tokens = c
                req.all_token_ids.append(t)
        else:
            for req, c in zip(reqs, computed.tolist()):
                req.num_computed_tokens = c
            for i, t in zip(pos.tolist(), toks):
                reqs[i].all_token_ids.append(t)
        self.num_tokens[pos] += 1
        if sched.pool.enable_prefix_caching:
            full = computed // self.block_size
            filled = np.flatnonzero(full > self.num_hashed)
            if len(filled):
                cache_full_blocks(sched, [reqs[i] for i in filled.tolist()])
            self.num_hashed[filled] = full[filled]

        ended = self._stops(sched, pos, tokens, toks)
        streamed = self.streaming[pos]
        plain = pos[streamed]
        # A first token leaves through the router, which streams everything so far: after that
        # the sequence streams plainly too. A finish leaves through the router as well.
        news = pos[~streamed]
        self.streaming[news] = True
        if ended:
            plain = np.setdiff1d(plain, ended, assume_unique=True)
            news = np.union1d(news, ended)
        for i in news.tolist():
            reqs[i].num_unstreamed += 1
            others.append(reqs[i])
        if len(plain):
            by_position = tokens  # the token of each position, when all sampled
            if len(pos) != len(reqs):
                by_position = np.zeros(len(reqs), dtype=np.int32)
                by_position[pos] = tokens
            self._stream(plain, by_position, outboxes)

    def _stops(self, sched: "Scheduler", pos: np.ndarray, tokens: np.ndarray,
               toks: list[int]) -> list[int]:
        """Finish the sequences whose token is a stop token or that reached their length."""
        ended = []
        if self.stop_tokens.size:
            for k in np.flatnonzero(np.isin(tokens, self.stop_tokens)).tolist():
                req = self.reqs[pos[k]]
                if toks[k] in req.stop_set and len(req.all_token_ids) >= req.min_stop_len:
                    sched.finish(req, FinishReason.STOP)
                    ended.append(int(pos[k]))
        for i in pos[self.num_tokens[pos] >= self.limit[pos]].tolist():
            if self.reqs[i].status is not Status.FINISHED:
                sched.finish(self.reqs[i], FinishReason.LENGTH)
                ended.append(i)
        return ended

    def _stream(self, plain: np.ndarray, by_position: np.ndarray,
                outboxes: dict[bytes, Outbox]) -> None:
        """One column entry per plainly streamed token (positions `plain`), per gateway."""
        everyone = len(plain) == len(self.reqs)
        for gw, member in self.gateways.items():
            box = outboxes.get(gw)
            if box is None:
                box = outboxes[gw] = Outbox()
            if everyone and len(self.gateways) == 1:
                box.add_columns(self.request_ids, self.indices, by_position)
                continue
            chosen = plain[member[plain]]
            if len(chosen):
                box.add_columns([self.request_ids[i] for i in chosen.tolist()], self.indices[chosen],
                                by_position[chosen])
