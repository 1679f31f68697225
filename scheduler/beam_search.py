"""Beam search, a sequence group (scheduler/sequence_group.py): a request's live beams are ordinary
sequences of its worker's batch that share blocks copy-on-write, and the search itself is
transformers' `_beam_search` (generation/utils.py, 5.x) for one prompt, step for step:

- the worker returns, for every live beam that reached the end of its tokens, its top K next
  tokens and their logprobs (SamplingConfig.beam_candidates = K, K = max(2, 1 + #EOS) x width,
  transformers' `beams_to_keep`) and leaves its own sampled token out of its copy;
- once every live beam has its candidates, `_advance` ranks cumulative logprobs, keeps the top K,
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

from proto import internal_pb2 as pb, pagoda_pb2
from proto.columns import unpack_f32, unpack_list
from scheduler import progress
from scheduler.batch import Batch
from scheduler.request import FinishReason, Request, Status
from scheduler.sequence_group import SequenceGroup, admit_whole
from scheduler.stream import Stream, Streams

if TYPE_CHECKING:
    from scheduler.step import Step

_F32 = np.float32


@dataclass
class Hypothesis:
    token_ids: list[int]      # output tokens, the ending one included
    score: float              # cum_logprob / generated_length ** length_penalty (float32)
    cum_logprob: float
    finish: FinishReason


@dataclass(eq=False, slots=True)
class BeamSearch(SequenceGroup):
    handle: Request           # the request as the router knows it (never in the batch)
    width: int
    length_penalty: float = 1.0
    early_stopping: str = "false"  # "true", "false" or "never"
    key: tuple[int, int] = field(init=False)
    # On its worker, from start():
    num_candidates: int = 0   # K, asked of the worker per beam
    prompt_len: int = 0
    max_length: int = 0       # prompt + max_tokens, or max_model_len
    cur_len: int = 0
    beams: list[Request] = field(default_factory=list)   # live, best first
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    candidates: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # by id(beam)
    cum_logprob: dict[str, float] = field(default_factory=dict)  # by seq_id; 0 for the first
    # Beams whose last token, the search's choice, is still to be named in a plan.
    unsent: set[str] = field(default_factory=set)
    improvable: bool = True   # transformers' is_early_stop_heuristic_unsatisfied
    results: list[Hypothesis] | None = None
    next_beam: int = 1
    suspect: bool = False     # it runs alone, whole (Scheduler.fail_oldest)

    outputs: list[Stream] = field(default_factory=list)  # its streams, one per index, from its end

    grows = True

    @classmethod
    def of(cls, handle: Request, params: pagoda_pb2.BeamSearchParams) -> BeamSearch:
        return cls(handle, params.beam_width,
                   params.length_penalty if params.HasField("length_penalty") else 1.0,
                   params.early_stopping or "false")

    def __post_init__(self) -> None:
        self.key = self.handle.sort_key()

    @property
    def num_seqs(self) -> int:
        return len(self.beams)

    @property
    def seats(self) -> int:
        return self.width

    @property
    def reserve(self) -> int:
        """Beams it may still fork into while it runs: room kept for them under max_num_seqs."""
        return self.width - len(self.beams) if self.handle.status is Status.RUNNING else 0

    def seqs(self) -> list[Request]:
        return list(self.beams)

    def start(self, sched: Batch) -> None:
        """One beam, the prompt; it forks once the prompt's candidates come."""
        handle = self.handle
        sampling = pb.SamplingConfig()
        sampling.CopyFrom(handle.sampling)
        beam0 = handle.derive(seq_id=f"{handle.request_id}#b0", index=0, sampling=sampling,
                              group=self)
        sched.add_sequence(beam0)
        self.num_candidates = max(2, 1 + len(beam0.stop_set)) * self.width
        sampling.beam_candidates = self.num_candidates
        self.prompt_len = self.cur_len = beam0.num_prompt_tokens
        self.max_length = beam0.length_limit
        self.beams, self.finished, self.candidates = [beam0], [], {}
        self.cum_logprob, self.unsent = {}, set()
        self.improvable, self.results, self.next_beam = True, None, 1
        self.suspect, handle.suspect = handle.suspect, False  # lost_steps.py: it runs alone
        handle.group = self

    # -- scheduling -----------------------------------------------------------------------------
    def schedule(self, sched: Batch, step: Step) -> None:
        """The group's tokens for this step: one each after an advance, or recompute chunks. All
        or none get their blocks, so a preemption never splits the group inside a step."""
        beams = self.beams
        if self.suspect or any(b.status is not Status.RUNNING or b.num_pending for b in beams):
            return  # its last step is still on the worker (or it runs alone)
        # New to the worker first: they copy a shared partial block, the held beam keeps it.
        todo = sorted((b for b in beams if b.num_computed_tokens < b.num_tokens),
                      key=lambda b: b.on_worker)
        work, budget = [], step.budget
        for b in todo:
            n = min(b.num_tokens - b.num_computed_tokens, budget)
            if n == 0:
                break
            work.append((b, n))
            budget -= n
        if not work:
            return
        while sched.kv.write_cost(work) > sched.kv.num_free:
            if not sched.preempt_for(self, step):
                return  # the group itself was the lowest-priority sequence left
        for b, n in work:
            blocks, copy = sched.kv.write_slots(b, n)
            if copy is not None:
                step.copy.append(copy)
            if b.seq_id in self.unsent and b.on_worker:
                step.next_token_slots.append(b.slot)
                step.next_token_ids.append(b.all_token_ids[-1])
            self.unsent.discard(b.seq_id)
            step.take(b, n, blocks)

    def admit(self, sched: Batch, step: Step) -> bool:
        """Whole, each beam with its prefix-cache hits, or not at all (strict order: nothing
        behind it goes first)."""
        return admit_whole(sched, self, self.beams, step) is not None

    def preempt(self, sched: Batch, step: Step) -> None:
        """Recompute, for the whole group: the candidates of a step still running are dropped
        when they come, and recomputed with the rest."""
        step.preempted = True
        sched.preemption.record("recompute")
        self._recompute(sched)

    def _recompute(self, sched: Batch) -> None:
        """Its beams wait off the queue; admit() takes them all."""
        for b in self.beams:
            b.num_preemptions += 1
        self.unsent.clear()
        self.candidates.clear()
        self.handle.num_preemptions += 1
        sched.recompute(self, self.beams)

    def requeue(self, sched: Batch, suspect: bool) -> None:
        if any(b.status is Status.RUNNING for b in self.beams):
            self.suspect = suspect  # it waits apart, and runs alone, as one
            self._recompute(sched)
        elif suspect and not self.suspect:  # preempted while the plans ran: in line already
            self.suspect = True
            sched.queues.requeue(self)

    def fail(self, sched: Batch, failed: list[Request], alone: bool) -> Request | None:
        if alone and self.suspect:
            self.end(sched, FinishReason.ERROR)  # it failed alone: the cause
            return self.handle
        self.requeue(sched, suspect=bool(failed))
        return None

    def end(self, sched: Batch, reason: FinishReason) -> None:
        """Every way a group ends: its live beams are freed, the handle finishes."""
        handle = self.handle
        if self.beams:  # what the first beam's admission measured
            handle.queue_time = self.beams[0].queue_time
            handle.num_cached_tokens = self.beams[0].num_cached_tokens
        for b in self.beams:
            sched.finish(b, reason)
        self.beams = []
        handle.finish_reason = reason
        sched.queues.end(self)

    def report_end(self, streams: Streams, seq: Request, error: pb.Error | None) -> None:
        """Each index gets its whole output, best first, and its finish, once (an abort or an
        error: every index ends with it, without tokens)."""
        handle, results = self.handle, self.results or []
        if not self.outputs:
            self.outputs = [Stream(handle.gateway, handle.request_id, i) for i in range(self.width)]
        for i, stream in enumerate(self.outputs):
            if stream.ended:
                continue
            finish, cum = int(handle.finish_reason or FinishReason.ABORT), None
            if i < len(results):
                if error is None:
                    streams.tokens(stream, results[i].token_ids, handle)
                finish, cum = int(results[i].finish), results[i].cum_logprob
            streams.end(stream, handle, finish, error, cum)

    def drained(self) -> list[Request]:
        """It starts again from its prompt."""
        self.beams, self.results = [], None
        return [self.handle]

    # -- results --------------------------------------------------------------------------------
    def on_logprobs(self, sched: Batch, seq: Request, logprobs: pb.SlotLogprobs) -> None:
        """A beam's sampled logprobs are its candidates; it asks for no prompt logprobs."""
        if logprobs.prompt or seq.status is not Status.RUNNING:
            return  # preempted while the step ran: recomputed with its group
        ids, values = unpack_list(logprobs.top_token_ids), unpack_f32(logprobs.top_logprobs)
        self.candidates[id(seq)] = list(zip(ids[:logprobs.k], values[:logprobs.k]))

    def on_sampled(self, sched: Batch, seq: Request, tokens: list[int]) -> bool:
        """The worker's own token is not the beam's next one: the search picks those."""
        return id(seq) in self.candidates

    def settle(self, sched: Batch) -> bool:
        """Once every live beam has its candidates: one step of the search."""
        if self.handle.status is Status.FINISHED or \
                not all(id(b) in self.candidates for b in self.beams):
            return False
        if self._advance(sched):
            self.report_end(sched.streams, self.handle, None)
            return True
        return False

    def _advance(self, sched: Batch) -> bool:
        """One step of transformers' beam search (batch size 1). Returns True when it is over."""
        width, k, lp_pow = self.width, self.num_candidates, self.length_penalty
        stop_set = self.beams[0].stop_set
        cands = []  # (total, beam order, rank, beam, token)
        for i, b in enumerate(self.beams):
            cum = _F32(self.cum_logprob.get(b.seq_id, 0.0))
            for rank, (token, lp) in enumerate(self.candidates.pop(id(b))):
                cands.append((cum + _F32(lp), i, rank, b, token))
        top = sorted(cands, key=lambda c: (-c[0], c[1], c[2]))[:k]
        at_max = self.cur_len + 1 >= self.max_length
        ends = [at_max or c[4] in stop_set for c in top]
        running = [c for c, e in zip(top, ends) if not e][:width]
        # Only the top `width` candidates may finish; the rest are there to keep `width` running.
        denom = (self.cur_len + 1 - self.prompt_len) ** lp_pow
        new = [Hypothesis(c[3].all_token_ids[self.prompt_len:] + [c[4]], _F32(c[0] / _F32(denom)),
                          float(c[0]),
                          FinishReason.STOP if c[4] in stop_set else FinishReason.LENGTH)
               for c, e in zip(top[:width], ends[:width]) if e]
        if new:
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:width]
        self.cur_len += 1
        if running:
            best_len = (self.max_length if self.early_stopping == "never" and lp_pow > 0.0
                        else self.cur_len) - self.prompt_len
            best_possible = _F32(running[0][0] / _F32(best_len ** lp_pow))
            if len(self.finished) == width:
                worst = min(h.score for h in self.finished)
                self.improvable = self.improvable and best_possible > worst
        full = self.early_stopping == "true" and len(self.finished) == width
        if all(ends) or not self.improvable or full:
            self.results = list(self.finished)
            self.end(sched, FinishReason.STOP)
            return True
        self._continue(sched, running)
        return False

    def _continue(self, sched: Batch, running) -> None:
        """The next live beams: forks first (from each parent's tokens before its own next one),
        then the beams without a continuation leave, then the parents take their best token."""
        kept: dict[int, Request] = {}
        live = []
        for total, _, _, parent, token in running:
            if id(parent) not in kept:
                kept[id(parent)] = parent
                live.append((parent, token, total))
                continue
            child = self._fork(sched, parent, token)
            self.cum_logprob[child.seq_id] = total
            live.append((child, None, total))
        for b in self.beams:
            if id(b) not in kept:
                sched.finish(b, FinishReason.STOP)  # dropped out of the beam
                self.cum_logprob.pop(b.seq_id, None)
                self.unsent.discard(b.seq_id)
        for b, token, total in live:
            if token is not None:
                b.all_token_ids.append(token)
                self.cum_logprob[b.seq_id] = total
                self.unsent.add(b.seq_id)
            sched.kv.cache_blocks(b)
        self.beams = [b for b, _, _ in live]

    def _fork(self, sched: Batch, parent: Request, token: int) -> Request:
        child = parent.derive(seq_id=f"{self.handle.request_id}#b{self.next_beam}", index=0,
                              queue_time=parent.queue_time,
                              all_token_ids=parent.all_token_ids + [token],
                              num_cached_tokens=parent.num_cached_tokens,
                              num_preemptions=parent.num_preemptions, group=self)
        self.next_beam += 1
        sched.kv.share(parent, child)
        progress.found(child, parent.num_computed_tokens)
        sched.queues.add(child, running=True)
        return child
