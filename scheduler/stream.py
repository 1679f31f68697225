"""The token stream's one owner in the scheduler: what each output sequence has sent its gateway,
and the one place that decides whether tokens go out now, go out with the sequence's first
figures, or wait for its finish (final_only). Results (scheduler/results.py) and beam search
(scheduler/beam_search.py) alike call its two verbs, `tokens` and `end`; the encoding is the
token stream's own (proto/token_stream.py, through scheduler/outbox.py).

A sequence's first tokens go out with its usage figures (prompt tokens, prefix-cache hit, queue
time, preemptions): the figures are written when the result that brought them is applied
(`flush`), so that a sequence that also ends in that result says everything in one delta."""
from __future__ import annotations

import time
from typing import Protocol

from proto import internal_pb2 as pb
from scheduler.outbox import Outboxes


class Usage(Protocol):
    """The figures a stream's first and last deltas carry (scheduler/request.py's Request)."""
    num_prompt_tokens: int
    num_cached_tokens: int
    queue_time: float
    num_preemptions: int
    arrival_time: float


class Stream:
    """One output sequence's stream to its gateway: (request_id, index)."""
    __slots__ = ("gateway", "request_id", "index", "final_only", "sent", "started", "ended",
                 "held", "first_token_time")

    def __init__(self, gateway: bytes, request_id: str, index: int,
                 final_only: bool = False) -> None:
        self.gateway, self.request_id, self.index = gateway, request_id, index
        self.final_only = final_only  # its tokens go out with its finish (AddRequest.final_only)
        self.sent = 0                 # output tokens in the outbox: the next one's offset
        self.started = False          # its first figures are written or due
        self.ended = False
        self.held: list[int] = []     # final_only: its tokens so far
        self.first_token_time = 0.0   # final_only: time.monotonic() of its first token


class Streams:
    """Every gateway's outbox and the streams' rule."""

    def __init__(self) -> None:
        self.outboxes = Outboxes()
        self._due: list[tuple[Stream, Usage]] = []  # first figures to write at the flush
        self._appends: dict[bytes, tuple] = {}  # each outbox's column appends, bound once

    def _open(self, gateway: bytes) -> tuple:
        appends = self._appends[gateway] = self.outboxes[gateway].appends()
        return appends

    def tokens(self, stream: Stream, ids: list[int], usage: Usage) -> None:
        """New output tokens of one sequence, in order, each exactly once."""
        if stream.final_only:
            stream.first_token_time = stream.first_token_time or time.monotonic()
            stream.held += ids
            return
        # The one path of every plain decode: the columns' appends, bound once per outbox.
        add_id, add_index, add_count, add_offset, add_tokens = \
            self._appends.get(stream.gateway) or self._open(stream.gateway)
        add_id(stream.request_id)
        add_index(stream.index)
        n = len(ids)
        add_count(n)
        add_offset(stream.sent)
        add_tokens(ids)
        stream.sent += n
        if not stream.started:
            stream.started = True
            self._due.append((stream, usage))

    def end(self, stream: Stream, usage: Usage, finish: int, error: pb.Error | None = None,
            cumulative_logprob: float | None = None) -> None:
        """The sequence ended: what it held, then its figures with its finish (and error)."""
        if stream.ended:
            return
        box = self.outboxes[stream.gateway]
        if stream.held:
            box.add(stream.request_id, stream.index, stream.held, stream.sent)
            stream.sent += len(stream.held)
        delta = _figures(stream, usage)
        delta.finish = finish
        if error is not None:
            delta.error.CopyFrom(error)
        if cumulative_logprob is not None:
            delta.cumulative_logprob = cumulative_logprob
        if stream.final_only and stream.sent:
            delta.first_token_s = (stream.first_token_time or time.monotonic()) - usage.arrival_time
        stream.held, stream.started, stream.ended = [], True, True
        box.deltas.append(delta)

    def refuse(self, gateway: bytes, request_id: str, error: pb.Error) -> None:
        """The answer to an add that never became a request: no stream, an error."""
        self.outboxes[gateway].deltas.append(pb.TokenDelta(request_id=request_id, finish=pb.ERROR,
                                                           error=error))

    def logprobs(self, stream: Stream, lp: pb.SlotLogprobs) -> None:
        """Logprobs go to the gateway as the worker computed them, named by request and index
        rather than slot: the gateway link's message, built from the worker link's."""
        self.outboxes[stream.gateway].logprobs.append(pb.Logprobs(
            request_id=stream.request_id, index=stream.index, prompt=lp.prompt,
            first_position=lp.first_position, token_ids=lp.token_ids, logprobs=lp.logprobs,
            ranks=lp.ranks, k=lp.k, top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs))

    def flush(self) -> None:
        """The first figures of the streams that started since, unless they ended meanwhile."""
        for stream, usage in self._due:
            if not stream.ended:
                self.outboxes[stream.gateway].deltas.append(_figures(stream, usage))
        self._due = []

    def take(self) -> dict[bytes, pb.SchedulerMessage]:
        """One message per gateway with everything since the last call."""
        self.flush()
        out = {gw: box.to_message() for gw, box in self.outboxes.items()}
        self.outboxes, self._appends = Outboxes(), {}
        return out


def _figures(stream: Stream, usage: Usage) -> pb.TokenDelta:
    return pb.TokenDelta(request_id=stream.request_id, index=stream.index,
                         prompt_tokens=usage.num_prompt_tokens,
                         cached_prompt_tokens=max(0, usage.num_cached_tokens),
                         queue_time_s=max(0.0, usage.queue_time),
                         num_preemptions=usage.num_preemptions, offset=stream.sent)
