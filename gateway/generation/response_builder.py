"""One GenerateRequest's answer, assembled from what the scheduler sends: token updates become text
(through each index's Detokenizer), Logprobs messages become TokenLogprob entries beside the tokens
they score, and each index's last message gets usage, matched_stop, seed and metrics.

The scheduler sends logprobs by sequence position, so they are matched to tokens by position
rather than by message boundaries: a token held back by the detokenizer, or dropped after a stop
string, keeps or loses its logprob with it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway import metrics
from gateway.generation.detokenize import Detokenizer
from gateway.tokenizer import TextTokenizer
from gateway.validation.validate import Validated
from proto import internal_pb2, pagoda_pb2
from proto.columns import unpack_f32, unpack_list
from proto.token_stream import Update

_FINISH = {
    internal_pb2.LENGTH: pagoda_pb2.FINISH_REASON_LENGTH,
    internal_pb2.STOP: pagoda_pb2.FINISH_REASON_STOP,
    internal_pb2.ABORT: pagoda_pb2.FINISH_REASON_ABORT,
}
_U64 = 2**64 - 1
_NO_NEWS = internal_pb2.TokenDelta()  # read-only: an update of tokens alone reads as this


def token_logprobs(tok: TextTokenizer, lp: internal_pb2.Logprobs) -> list[pagoda_pb2.TokenLogprob]:
    """A Logprobs message's columns as one TokenLogprob per scored position, in order."""
    ids, values, ranks = unpack_list(lp.token_ids), unpack_f32(lp.logprobs).tolist(), unpack_list(lp.ranks)
    top_ids, top_values = unpack_list(lp.top_token_ids), unpack_f32(lp.top_logprobs).tolist()
    if not len(ids) == len(values) == len(ranks) or not len(top_ids) == len(ids) * lp.k == len(top_values):
        raise ValueError("a Logprobs message's columns do not line up")
    out, k = [], lp.k
    for i, token_id in enumerate(ids):
        top = [pagoda_pb2.TopLogprob(token_id=t, logprob=v, text=tok.token_text(t))
               for t, v in zip(top_ids[i * k:(i + 1) * k], top_values[i * k:(i + 1) * k])]
        out.append(pagoda_pb2.TokenLogprob(
            token_id=token_id, logprob=values[i], rank=ranks[i], text=tok.token_text(token_id),
            token_bytes=tok.token_bytes(token_id), top_logprobs=top))
    return out


@dataclass
class IndexState:
    detok: Detokenizer
    seed: int
    done: bool = False
    finished_by_scheduler: bool = False
    cached_prompt_tokens: int = 0  # the scheduler reports it with the first tokens and the last
    queue_time_s: float = 0.0
    num_preemptions: int = 0
    first_token_at: float | None = None
    logprobs: dict[int, pagoda_pb2.TokenLogprob] = field(default_factory=dict)  # by output index


class ResponseBuilder:
    """Turns the internal items of one request into GenerateResponses (None: nothing to show)."""

    def __init__(self, tok: TextTokenizer, v: Validated, request_id: str, started: float):
        self.tok, self.v, self.request_id, self.started = tok, v, request_id, started
        self.prompt_len = len(v.prompt_token_ids)
        self.indices = [
            IndexState(Detokenizer(tok, v.stop, v.prompt_token_ids, v.skip_special_tokens,
                                   include_stop=v.include_stop_str_in_output, min_tokens=v.min_tokens),
                       seed=(v.seed + i) & _U64)  # the scheduler seeds index i with seed + i
            for i in range(v.n)]
        self.prompt_logprobs: dict[int, pagoda_pb2.TokenLogprob] = {}  # by prompt position
        self.sent_first = False  # index 0's first message carries the prompt's extras
        self.saw_first_token = False  # the request's first token, of any index: the TTFT metric
        self.sent_at: float | None = None  # when the AddRequest went to the scheduler

    @property
    def all_done(self) -> bool:
        return all(ix.done for ix in self.indices)

    @property
    def all_finished_by_scheduler(self) -> bool:
        return all(ix.finished_by_scheduler for ix in self.indices)

    def on_logprobs(self, lp: internal_pb2.Logprobs) -> None:
        entries = token_logprobs(self.tok, lp)
        if lp.prompt:
            for i, entry in enumerate(entries):
                self.prompt_logprobs.setdefault(lp.first_position + i, entry)  # recompute repeats
        elif lp.index < len(self.indices):
            first = lp.first_position - self.prompt_len
            for i, entry in enumerate(entries):
                self.indices[lp.index].logprobs[first + i] = entry

    def on_update(self, update: Update) -> pagoda_pb2.GenerateResponse | None:
        """A final_only request's (AddRequest.final_only) tokens all come with its finish: its time
        to first token is the scheduler's first_token_s after the request went out."""
        news = update.news if update.news is not None else _NO_NEWS
        ix = self.indices[update.index]
        start = len(ix.detok.token_ids)
        text, ids = ix.detok.add_many(update.token_ids)
        if ids and ix.first_token_at is None:
            if news.first_token_s and self.sent_at is not None:  # final_only: the scheduler's time
                ix.first_token_at = min(self.sent_at + news.first_token_s, time.monotonic())
            else:
                ix.first_token_at = time.monotonic()
            if not self.saw_first_token:
                self.saw_first_token = True
                metrics.TIME_TO_FIRST_TOKEN.observe(ix.first_token_at - self.started)
        ix.cached_prompt_tokens = news.cached_prompt_tokens or ix.cached_prompt_tokens
        if news.prompt_tokens:  # the first news and the last carry the scheduler's figures
            ix.queue_time_s, ix.num_preemptions = news.queue_time_s, news.num_preemptions
        reason = pagoda_pb2.FINISH_REASON_UNSPECIFIED
        if ix.detok.stopped:
            reason = pagoda_pb2.FINISH_REASON_STOP
            ix.finished_by_scheduler = news.finish != internal_pb2.NOT_FINISHED
        elif news.finish != internal_pb2.NOT_FINISHED:
            text += ix.detok.finish()
            reason = _FINISH.get(news.finish, pagoda_pb2.FINISH_REASON_ABORT)
            ix.finished_by_scheduler = True
        if reason == pagoda_pb2.FINISH_REASON_UNSPECIFIED and not text and not ids:
            return None  # nothing new to show yet
        response = pagoda_pb2.GenerateResponse(
            request_id=self.request_id, index=update.index, text=text, token_ids=ids,
            finish_reason=reason)
        if self.v.logprobs is not None:
            response.logprobs.extend(ix.logprobs.pop(start + i) for i in range(len(ids))
                                     if start + i in ix.logprobs)
        if update.index == 0 and not self.sent_first:
            self.sent_first = True
            if self.v.return_prompt_token_ids:
                response.prompt_token_ids.extend(self.v.prompt_token_ids)
            if self.v.prompt_logprobs is not None:
                response.prompt_logprobs.extend(self.prompt_logprobs[p] for p in sorted(self.prompt_logprobs))
        if reason != pagoda_pb2.FINISH_REASON_UNSPECIFIED:
            self._finish(ix, news, response)
        return response

    def _finish(self, ix: IndexState, news: internal_pb2.TokenDelta,
                response: pagoda_pb2.GenerateResponse) -> None:
        ix.done = True
        ix.logprobs.clear()
        # A stop-string finish comes before the scheduler's own: use what earlier news said.
        response.usage.CopyFrom(pagoda_pb2.Usage(
            prompt_tokens=news.prompt_tokens or self.prompt_len,
            completion_tokens=len(ix.detok.token_ids),
            cached_prompt_tokens=ix.cached_prompt_tokens))
        if ix.detok.stopped:
            response.matched_stop_str = ix.detok.stop.matched
        elif news.finish == internal_pb2.STOP and ix.detok.token_ids:
            response.matched_token_id = ix.detok.token_ids[-1]  # an EOS or a stop id ended it
        if self.v.beam is None:
            response.seed = ix.seed
        elif news.HasField("cumulative_logprob"):
            response.cumulative_logprob = news.cumulative_logprob
        now = time.monotonic()
        if ix.first_token_at is not None and len(ix.detok.token_ids) > 1:
            metrics.TIME_PER_OUTPUT_TOKEN.observe(
                (now - ix.first_token_at) / (len(ix.detok.token_ids) - 1))
        response.metrics.CopyFrom(pagoda_pb2.RequestMetrics(
            queue_time_s=ix.queue_time_s, num_preemptions=ix.num_preemptions,
            time_to_first_token_s=(ix.first_token_at or now) - self.started,
            e2e_time_s=now - self.started))
