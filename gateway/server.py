"""pagoda.v1.Generation over grpc.aio: validation, streaming, status codes, aborts.

One RPC = one internal request. Its deltas arrive on a queue fed by the SchedulerClient; each
output index has its own Detokenizer. Whatever way the RPC ends before the scheduler finished
every index (client cancel, deadline, stop string, error, server shutdown), the `finally` sends an
AbortRequest so the scheduler frees the request's KV blocks at once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from gateway import metrics
from gateway.detokenize import Detokenizer
from gateway.scheduler_client import SchedulerClient, SchedulerUnavailable
from gateway.tokenizer import TextTokenizer
from gateway.validate import Limits, ValidationError, prompt_ids, validate
from proto import internal_pb2, pagoda_pb2, pagoda_pb2_grpc

log = logging.getLogger("pagoda.gateway")

_FINISH = {
    internal_pb2.LENGTH: pagoda_pb2.FINISH_REASON_LENGTH,
    internal_pb2.STOP: pagoda_pb2.FINISH_REASON_STOP,
    internal_pb2.ABORT: pagoda_pb2.FINISH_REASON_ABORT,
}


class RpcFailed(Exception):
    """Ends an RPC with a status; raised inside the stream, turned into context.abort outside."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def status_code(name: str) -> grpc.StatusCode:
    """An internal Error.code (a grpc.StatusCode name) as a status; unknown or OK -> INTERNAL."""
    code = grpc.StatusCode.__members__.get(name)
    return code if code is not None and code != grpc.StatusCode.OK else grpc.StatusCode.INTERNAL


@dataclass
class _Index:
    detok: Detokenizer
    done: bool = False
    finished_by_scheduler: bool = False
    cached_prompt_tokens: int = 0  # the scheduler reports it on the first delta and the last


def _record_end(method: str, code: grpc.StatusCode, started: float) -> None:
    metrics.IN_FLIGHT.dec()
    metrics.REQUESTS.labels(method, code.name).inc()
    if code == grpc.StatusCode.OK:
        metrics.E2E_LATENCY.labels(method).observe(time.monotonic() - started)


class GenerationServicer(pagoda_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: TextTokenizer, client: SchedulerClient):
        self.tokenizer = tokenizer
        self.client = client

    def _limits(self) -> Limits:
        info = self.client.info
        if info is None or info.num_workers < 1:
            raise RpcFailed(grpc.StatusCode.UNAVAILABLE,
                            "no workers are registered with the scheduler yet" if info is not None
                            else "the scheduler has not answered yet")
        return Limits(max_model_len=info.max_model_len,
                      vocab_size=info.vocab_size or self.tokenizer.vocab_size)

    # ------------------------------------------------------------------ Generate*

    async def GenerateStream(self, request, context) -> AsyncIterator[pagoda_pb2.GenerateResponse]:
        started = time.monotonic()
        code = grpc.StatusCode.OK
        metrics.IN_FLIGHT.inc()
        try:
            first = True
            # aclosing: a cancel that lands while this handler waits at `yield` must still run
            # _generate's finally (the abort) now, not whenever the generator is collected.
            async with aclosing(self._generate(request, unary=False)) as responses:
                async for response in responses:
                    if first and response.token_ids:
                        metrics.TIME_TO_FIRST_TOKEN.observe(time.monotonic() - started)
                        first = False
                    yield response
        except RpcFailed as e:
            code = e.code
            await context.abort(e.code, str(e))
        except (asyncio.CancelledError, GeneratorExit):
            code = _cancel_code(context)
            raise
        finally:
            _record_end("GenerateStream", code, started)

    async def Generate(self, request, context) -> pagoda_pb2.GenerateResponse:
        started = time.monotonic()
        code = grpc.StatusCode.OK
        metrics.IN_FLIGHT.inc()
        try:
            out = pagoda_pb2.GenerateResponse()
            async with aclosing(self._generate(request, unary=True)) as responses:
                async for response in responses:
                    if response.token_ids and not out.token_ids:
                        metrics.TIME_TO_FIRST_TOKEN.observe(time.monotonic() - started)
                    out.request_id = response.request_id
                    out.text += response.text
                    out.token_ids.extend(response.token_ids)
                    out.finish_reason = response.finish_reason
                    if response.HasField("usage"):
                        out.usage.CopyFrom(response.usage)
            return out
        except RpcFailed as e:
            code = e.code
            await context.abort(e.code, str(e))
        except asyncio.CancelledError:
            code = _cancel_code(context)
            raise
        finally:
            _record_end("Generate", code, started)

    async def _generate(self, request: pagoda_pb2.GenerateRequest, unary: bool
                        ) -> AsyncIterator[pagoda_pb2.GenerateResponse]:
        limits = self._limits()
        internal_id = self.client.new_request_id()
        request_id = request.request_id or internal_id
        try:
            v = await _off_loop_if_large(request, validate, request, self.tokenizer, limits,
                                         internal_id, unary=unary)
        except ValidationError as e:
            raise RpcFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        metrics.PROMPT_TOKENS.inc(len(v.prompt_token_ids))
        indices = [_Index(Detokenizer(self.tokenizer, v.stop, v.prompt_token_ids)) for _ in range(v.n)]
        queue = self.client.open(internal_id)
        sent = False
        try:
            try:
                self.client.add(v.add)
            except SchedulerUnavailable as e:
                raise RpcFailed(grpc.StatusCode.UNAVAILABLE, str(e)) from None
            sent = True
            while not all(ix.done for ix in indices):
                delta: internal_pb2.TokenDelta = await queue.get()
                if delta.finish == internal_pb2.ERROR:
                    raise RpcFailed(status_code(delta.error.code),
                                    delta.error.message or "the scheduler failed the request")
                if delta.index >= len(indices) or indices[delta.index].done:
                    continue  # e.g. tokens of an index already ended by a stop string
                ix = indices[delta.index]
                response = self._on_delta(ix, delta, request_id, len(v.prompt_token_ids))
                if ix.detok.stopped and not ix.finished_by_scheduler and len(indices) > 1:
                    # A stop string ended this sequence while its siblings go on: free its
                    # blocks now rather than when the whole request ends.
                    self.client.abort(internal_id, (delta.index,))
                    ix.finished_by_scheduler = True
                if response is not None:
                    metrics.TOKENS_STREAMED.inc(len(response.token_ids))
                    yield response
        finally:
            self.client.release(internal_id)
            if sent and not all(ix.finished_by_scheduler for ix in indices):
                self.client.abort(internal_id)

    def _on_delta(self, ix: _Index, delta: internal_pb2.TokenDelta, request_id: str,
                  prompt_len: int) -> pagoda_pb2.GenerateResponse | None:
        text, ids = ix.detok.add_many(delta.token_ids)
        ix.cached_prompt_tokens = delta.cached_prompt_tokens or ix.cached_prompt_tokens
        reason = pagoda_pb2.FINISH_REASON_UNSPECIFIED
        if ix.detok.stopped:
            reason = pagoda_pb2.FINISH_REASON_STOP
            ix.finished_by_scheduler = delta.finish != internal_pb2.NOT_FINISHED
        elif delta.finish != internal_pb2.NOT_FINISHED:
            text += ix.detok.finish()
            reason = _FINISH.get(delta.finish, pagoda_pb2.FINISH_REASON_ABORT)
            ix.finished_by_scheduler = True
        if reason == pagoda_pb2.FINISH_REASON_UNSPECIFIED and not text and not ids:
            return None  # nothing new to show yet
        response = pagoda_pb2.GenerateResponse(
            request_id=request_id, index=delta.index, text=text, token_ids=ids, finish_reason=reason)
        if reason != pagoda_pb2.FINISH_REASON_UNSPECIFIED:
            ix.done = True
            # A stop-string finish comes before the scheduler's own: use what earlier deltas said.
            response.usage.CopyFrom(pagoda_pb2.Usage(
                prompt_tokens=delta.prompt_tokens or prompt_len,
                completion_tokens=len(ix.detok.token_ids),
                cached_prompt_tokens=ix.cached_prompt_tokens))
        return response

    # ------------------------------------------------------------------ Tokenize, GetModelInfo

    async def Tokenize(self, request, context) -> pagoda_pb2.TokenizeResponse:
        code = grpc.StatusCode.OK
        try:
            vocab = self.client.info.vocab_size if self.client.info else 0
            _, ids = await _off_loop_if_large(request, prompt_ids, request, self.tokenizer,
                                              vocab or self.tokenizer.vocab_size)
            return pagoda_pb2.TokenizeResponse(
                token_ids=ids, tokens=[self.tokenizer.id_to_token(i) for i in ids])
        except ValidationError as e:
            code = grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(e))
        finally:
            metrics.REQUESTS.labels("Tokenize", code.name).inc()

    async def GetModelInfo(self, request, context) -> pagoda_pb2.ModelInfo:
        metrics.REQUESTS.labels("GetModelInfo", "OK").inc()
        # Before the first ClusterInfo, answer with what the tokenizer knows and 0 workers.
        info = self.client.info or internal_pb2.ClusterInfo()
        return pagoda_pb2.ModelInfo(
            model=info.model or self.tokenizer.name, max_model_len=info.max_model_len,
            vocab_size=info.vocab_size or self.tokenizer.vocab_size, block_size=info.block_size,
            num_workers=info.num_workers, eos_token_ids=self.tokenizer.eos_token_ids)


# Tokenizing a prompt of this size takes about a millisecond; larger ones (up to
# --max-message-bytes) go to a thread so they do not stall every other stream on the loop.
_INLINE_REQUEST_BYTES = 32 * 1024


async def _off_loop_if_large(request, fn, *args, **kwargs):
    if request.ByteSize() <= _INLINE_REQUEST_BYTES:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


def _cancel_code(context) -> grpc.StatusCode:
    remaining = context.time_remaining()
    return (grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0
            else grpc.StatusCode.CANCELLED)
