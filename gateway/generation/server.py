"""pagoda.v1.Generation over grpc.aio: validation, streaming, status codes, aborts.

One RPC = one internal request. Its updates and logprobs arrive on a queue fed by the
SchedulerClient and become responses in gateway/generation/response_builder.py. Whatever way the RPC ends
before the scheduler finished every index (client cancel, deadline, stop string, error, server shutdown),
the `finally` sends an AbortRequest so the scheduler frees the request's KV blocks at once.

Every handler ends in a status a client can act on, through gateway/statuses.py: INVALID_ARGUMENT
naming the field, the scheduler's code (UNAVAILABLE, RESOURCE_EXHAUSTED, ALREADY_EXISTS), or
INTERNAL with a short message for anything unexpected (the traceback goes to the log, never to
the client).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import time
from contextlib import aclosing
from typing import AsyncIterator, Callable

import grpc

from gateway import metrics
from gateway.grammar import grammar_check
from gateway.generation.answer_budget import AnswerBudget
from gateway.validation.beam_request import add_completion
from gateway.bounds.call_bounds import peer_host
from gateway.bounds.client_auth import parse_range, priority_ranges, tenant_of
from gateway.bounds.edge import EdgeConfig
from gateway.grammar.grammar_check import CompilerBusy
from gateway.grammar.grammar_service import GrammarService
from gateway.bounds.grpc_bounds import context_bound
from gateway.generation.large_inputs import Busy, LargeJobs, tokenize_response
from gateway.generation.response_builder import ResponseBuilder
from gateway.scheduler_link.scheduler_client import (SchedulerBusy, SchedulerClient,
                                                     SchedulerUnavailable)
from gateway.statuses import REFUSALS, RpcFailed, ending, refused, status_code
from gateway.tokenizer import TextTokenizer
from gateway.validation.limits import Limits
from gateway.validation.validate import (Caller, ValidationError, check_abort_ids, check_ids,
                                         tokenize_parts, validate)
from proto import internal_pb2, pagoda_pb2, pagoda_pb2_grpc


def _record_end(method: str, started: float) -> Callable[[grpc.StatusCode], None]:
    """A Generate call's end in the metrics: its status, and its latency when it answered."""
    def record(code: grpc.StatusCode) -> None:
        metrics.IN_FLIGHT.dec()
        metrics.REQUESTS.labels(method, code.name).inc()
        if code == grpc.StatusCode.OK:
            metrics.E2E_LATENCY.labels(method).observe(time.monotonic() - started)
    return record


def _unary(method):
    """A unary RPC other than Generate, ended as every handler is (gateway/statuses.py)."""
    name = method.__name__

    def record(code: grpc.StatusCode) -> None:
        metrics.REQUESTS.labels(name, code.name).inc()

    @functools.wraps(method)
    async def handler(self, request, context):
        async with ending(context, name, record):
            return await method(self, request, context)
    return handler


class GenerationServicer(pagoda_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: TextTokenizer, client: SchedulerClient,
                 limits: Limits | None = None, api_keys: tuple[str, ...] = (),
                 edge: EdgeConfig = EdgeConfig(), client_host: Callable[[str], str] = peer_host):
        self.tokenizer = tokenizer
        self.client_host = client_host  # context.peer() -> the client's address (grpc_front.py)
        self.client = client
        self.api_keys = api_keys  # each one a tenant: its request ids are its own (client_auth.py)
        # False: the tenant is part of every cache salt, so no tenant's prefix-cache hits (and
        # their timing) reveal what another tenant sent.
        self.shared_prefix_cache = edge.shared_prefix_cache
        # Which priorities each tenant may ask for; without keys, --max-priority alone bounds it.
        self.priority_ranges = priority_ranges(list(edge.tenant_priority), api_keys)
        self.default_priority = (parse_range(edge.default_tenant_priority)
                                 if edge.default_tenant_priority and api_keys else None)
        self.grammar_timeout = edge.max_grammar_compile_seconds
        self.grammar = GrammarService(tokenizer, lambda: self._vocab_size, edge, bool(api_keys))
        # The flags' bounds; max_model_len and vocab_size come from the scheduler per request.
        self.base_limits = limits or Limits(max_model_len=0, vocab_size=0)
        self.large_jobs = LargeJobs(self.base_limits.max_large_input_jobs,
                                    self.base_limits.large_input_wait_seconds,
                                    self.base_limits.max_large_input_bytes)
        self.answers = AnswerBudget(
            self.base_limits.max_whole_answer_bytes, self.base_limits.max_whole_answers_bytes,
            lambda message: RpcFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, message), tokenizer)

    async def _large(self, request, fn, *args, **kwargs):
        """fn's work for a request, off the loop and bounded when it is large (large_inputs.py)."""
        try:
            return await self.large_jobs.run(request, fn, *args, **kwargs)
        except Busy as e:
            raise refused(e) from None

    def _limits(self) -> Limits:
        info = self.client.info
        if info is None or info.num_workers < 1:
            raise RpcFailed(grpc.StatusCode.UNAVAILABLE,
                            "no workers are registered with the scheduler yet" if info is not None
                            else "the scheduler has not answered yet")
        return dataclasses.replace(self.base_limits, max_model_len=info.max_model_len,
                                   vocab_size=info.vocab_size or self.tokenizer.vocab_size)

    @property
    def _vocab_size(self) -> int:
        info = self.client.info
        return (info.vocab_size if info is not None else 0) or self.tokenizer.vocab_size

    # ------------------------------------------------------------------ Generate*

    async def GenerateStream(self, request, context) -> AsyncIterator[pagoda_pb2.GenerateResponse]:
        started = time.monotonic()
        metrics.IN_FLIGHT.inc()
        grammar_check.CLIENT.set(self.client_host(context.peer()))  # this RPC's task only
        async with ending(context, "GenerateStream", _record_end("GenerateStream", started)):
            # aclosing: a cancel that lands while this handler waits at `yield` must still run
            # responses' finally (the abort) now, not whenever the generator is collected.
            async with aclosing(self.responses(request, started, unary=False,
                                               tenant=self._tenant(context))) as responses:
                async for response in responses:
                    yield response

    async def Generate(self, request, context) -> pagoda_pb2.GenerateResponse:
        started = time.monotonic()
        metrics.IN_FLIGHT.inc()
        grammar_check.CLIENT.set(self.client_host(context.peer()))  # this RPC's task only
        async with ending(context, "Generate", _record_end("Generate", started)):
            out, texts = pagoda_pb2.GenerateResponse(), []
            async with aclosing(self.responses(request, started, unary=True, whole=True,
                                               tenant=self._tenant(context))) as responses:
                async for response in responses:
                    if request.HasField("beam_search"):  # beam_width whole answers
                        add_completion(out, response)
                        continue
                    # MergeFrom appends the lists and lets the last message's scalars (finish,
                    # usage, seed, ...) win; the text is joined once at the end: a string set
                    # on a message stays in its arena until the message dies, so setting the
                    # text joined so far at each token kept every prefix (8,184 tokens held
                    # 174 MB for a 2.7 MB answer; joined once, 12 MB).
                    texts.append(response.text)
                    response.ClearField("text")
                    out.MergeFrom(response)
            if texts:
                out.text = "".join(texts)
            return out

    def spawn_grammar(self) -> asyncio.Task:
        return self.grammar.spawn()

    def warm_grammar(self) -> asyncio.Task | None:
        """None before the scheduler has said the vocabulary's size."""
        return self.grammar.warm() if self.client.info is not None else None

    async def grammar_error(self, spec, tenant: str = "") -> str | None:
        """Why the spec does not compile (or within --max-grammar-compile-seconds); None if it
        does. RpcFailed UNAVAILABLE when the compiler cannot start, RESOURCE_EXHAUSTED when none
        is free in time. The compilers are shared fairly by tenant (by peer without API keys)."""
        try:
            return await self.grammar.error(spec, tenant)
        except CompilerBusy as e:
            name = "sampling.structured_output"
            raise RpcFailed(REFUSALS[CompilerBusy], f"{name}: {e}", name) from None
        except RuntimeError as e:  # its compiler did not start: not the request's fault
            raise RpcFailed(grpc.StatusCode.UNAVAILABLE, str(e)) from None

    async def _check_grammar(self, spec, tenant: str) -> None:
        why = await self.grammar_error(spec, tenant)
        if why is not None:
            name = f"sampling.structured_output.{spec.kind}"
            raise RpcFailed(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {why}", name)

    async def close(self) -> None:
        await self.grammar.close()
        self.large_jobs.close()

    def _tenant(self, context) -> str:
        return tenant_of(context.invocation_metadata(), self.api_keys) if self.api_keys else ""

    async def responses(self, request: pagoda_pb2.GenerateRequest, started: float, unary: bool,
                        tenant: str = "", whole: bool = False) -> AsyncIterator[pagoda_pb2.GenerateResponse]:
        """The responses of one request, for GenerateStream, Generate and the HTTP API alike;
        raises RpcFailed. Closing it early aborts the request at the scheduler. tenant
        namespaces the public request id by API key. whole: the caller answers only once the
        request has ended (validate's Caller.whole)."""
        limits = self._limits()
        if not self.client.has_room(tenant=tenant):  # before tokenizing: refused cheaply
            raise RpcFailed(REFUSALS[SchedulerBusy],
                            "the scheduler is full (every sequence it can hold is in flight); "
                            "retry later")
        internal_id = self.client.new_request_id()
        caller = Caller(tenant=tenant, priorities=self.priority_ranges.get(tenant, self.default_priority),
                        salt_by_tenant=not self.shared_prefix_cache, whole=whole)
        try:
            v = await self._large(request, validate, request, self.tokenizer, limits,
                                  internal_id, unary=unary, caller=caller)
        except ValidationError as e:
            raise refused(e) from None
        if v.spec is not None:
            await self._check_grammar(v.spec, tenant)
        builder = ResponseBuilder(self.tokenizer, v, v.public_id, started)
        try:
            queue = self.client.open(internal_id, v.n, tenant)
        except SchedulerBusy as e:
            raise refused(e) from None
        metrics.PROMPT_TOKENS.inc(len(v.prompt_token_ids))
        sent, held = False, None
        try:
            if whole and (v.logprobs is not None or v.prompt_logprobs is not None):
                held = self.answers.hold_for(v)  # refused when the gateway holds too much
            try:
                self.client.add(v.add)
                builder.sent_at = time.monotonic()
            except SchedulerUnavailable as e:
                raise refused(e) from None
            sent = True
            while not builder.all_done:
                item = await queue.get()
                if isinstance(item, internal_pb2.Logprobs):
                    builder.on_logprobs(item)
                    continue
                if item.finish == internal_pb2.ERROR:
                    raise RpcFailed(status_code(item.news.error.code),
                                    item.news.error.message or "the scheduler failed the request")
                if item.index >= v.n or builder.indices[item.index].done:
                    continue  # e.g. tokens of an index already ended by a stop string
                ix = builder.indices[item.index]
                response = builder.on_update(item)
                if ix.detok.stopped and not ix.finished_by_scheduler and v.n > 1:
                    # A stop string ended this sequence while its siblings go on: free its
                    # blocks now rather than when the whole request ends.
                    self.client.abort(internal_id, (item.index,))
                    ix.finished_by_scheduler = True
                if response is not None:
                    if held is not None:
                        held.keep(response.ByteSize())
                    metrics.TOKENS_STREAMED.inc(len(response.token_ids))
                    yield response
        finally:
            if held is not None:
                held.release()
            self.client.release(internal_id)
            if sent and not builder.all_finished_by_scheduler:
                self.client.abort(internal_id)

    # ------------------------------------------------------------------ the other RPCs

    @_unary
    async def Tokenize(self, request, context) -> pagoda_pb2.TokenizeResponse:
        limits = dataclasses.replace(self.base_limits, vocab_size=self._vocab_size,
                                     max_model_len=context_bound(self.client.info))
        return await self._large(request, self._tokenize, request, limits)

    def _tokenize(self, request, limits: Limits) -> pagoda_pb2.TokenizeResponse:
        return tokenize_response(*tokenize_parts(request, self.tokenizer, limits), self.tokenizer)

    @_unary
    async def Detokenize(self, request, context) -> pagoda_pb2.DetokenizeResponse:
        longest = context_bound(self.client.info)
        if len(request.token_ids) > longest:  # keeps the answer under gRPC's computed send limit
            raise ValidationError("token_ids", f"token_ids has {len(request.token_ids)} ids, more "
                                               f"than max_model_len {longest}")
        check_ids(request.token_ids, self._vocab_size, "token_ids")  # counted first: then max()
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await self._large(request, self.tokenizer.decode, request.token_ids, skip)
        return pagoda_pb2.DetokenizeResponse(text=text)

    @_unary
    async def Abort(self, request, context) -> pagoda_pb2.AbortResponse:
        check_abort_ids(request.request_ids, self.base_limits)
        tenant = self._tenant(context)
        reply = await self.client.call(internal_pb2.Call(abort=pagoda_pb2.AbortRequest(
            request_ids=[tenant + rid for rid in request.request_ids])))
        return pagoda_pb2.AbortResponse(
            request_ids=[rid[len(tenant):] for rid in reply.abort.request_ids])

    @_unary
    async def GetLoads(self, request, context) -> pagoda_pb2.GetLoadsResponse:
        loads = (await self.client.call(internal_pb2.Call(get_loads=True))).loads
        # A worker's id is its hostname and pid by default: clients see a label instead, the same
        # for the same worker on this gateway, that names neither (the scheduler's metrics do).
        for w in loads.workers:
            w.worker_id = "worker-" + hmac.new(self.client.gateway_id.encode(), w.worker_id.encode(),
                                               "sha256").hexdigest()[:12]
        return loads

    @_unary
    async def GetModelInfo(self, request, context) -> pagoda_pb2.ModelInfo:
        # Before the first ClusterInfo, answer with what the tokenizer knows and 0 workers. EOS
        # ids are the scheduler's only: they are what it stops on.
        info = self.client.info or internal_pb2.ClusterInfo()
        return pagoda_pb2.ModelInfo(
            model=info.model or self.tokenizer.name, max_model_len=info.max_model_len,
            vocab_size=info.vocab_size or self.tokenizer.vocab_size, block_size=info.block_size,
            num_workers=info.num_workers, eos_token_ids=info.eos_token_ids)


