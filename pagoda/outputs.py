"""The offline API's outputs, named and shaped as vLLM's: RequestOutput and what it holds, gathered
from the gateway's responses (pagoda/offline.py runs the requests; pagoda/params.py builds them)."""
from __future__ import annotations

import time
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from proto import pagoda_pb2 as pb

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
          pb.FINISH_REASON_ABORT: "abort"}


@dataclass
class Logprob:
    logprob: float
    rank: int | None
    decoded_token: str


@dataclass
class RequestMetrics:
    queue_time_s: float
    time_to_first_token_s: float
    e2e_time_s: float
    num_preemptions: int


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the EOS/stop id or stop string that ended it
    # Per position: token id -> Logprob, the sampled token and the top k (vLLM's shape).
    logprobs: list[dict[int, Logprob]] | None = None
    seed: int | None = None
    metrics: RequestMetrics | None = None
    cumulative_logprob: float | None = None  # beam search


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = True
    num_cached_tokens: int = 0


def _logprobs(entries) -> list[dict[int, Logprob]]:
    out = []
    for lp in entries:
        position = {t.token_id: Logprob(t.logprob, i + 1, t.text) for i, t in enumerate(lp.top_logprobs)}
        position[lp.token_id] = Logprob(lp.logprob, lp.rank, lp.text)
        out.append(position)
    return out


class GenerationError(RuntimeError):
    """A request the servers refused or failed; code is the gRPC status name."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


async def collect(servicer, tokenizer, request: pb.GenerateRequest, request_id: str) -> RequestOutput:
    """One request through the gateway's own response generator, gathered into a RequestOutput."""
    from gateway.statuses import RpcFailed

    # Filled as the indices arrive: the request's n is the caller's until the servicer has
    # checked it (a list of n built here first took 20 GB for n = 10^9, and the OOM killer).
    outputs: dict[int, CompletionOutput] = {}
    prompt_ids: list[int] = []
    prompt_lps = None
    cached = 0
    try:
        async with aclosing(servicer.responses(request, time.monotonic(), unary=False)) as responses:
            async for r in responses:
                out = outputs.setdefault(r.index, CompletionOutput(index=r.index))
                if r.prompt_token_ids:
                    prompt_ids = list(r.prompt_token_ids)
                if r.prompt_logprobs:
                    prompt_lps = [None] + _logprobs(r.prompt_logprobs)
                out.text += r.text
                out.token_ids += r.token_ids
                if request.sampling.HasField("logprobs"):
                    out.logprobs = (out.logprobs or []) + _logprobs(r.logprobs)
                if r.finish_reason:
                    out.finish_reason = FINISH.get(r.finish_reason)
                    kind = r.WhichOneof("matched_stop")
                    out.stop_reason = getattr(r, kind) if kind else None
                    out.seed = r.seed if r.HasField("seed") else None
                    if r.HasField("cumulative_logprob"):
                        out.cumulative_logprob = r.cumulative_logprob
                    m = r.metrics
                    out.metrics = RequestMetrics(m.queue_time_s, m.time_to_first_token_s,
                                                 m.e2e_time_s, m.num_preemptions)
                    cached = max(cached, r.usage.cached_prompt_tokens)
    except RpcFailed as e:
        code = e.code.name if isinstance(e.code, grpc.StatusCode) else str(e.code)
        raise GenerationError(code, str(e)) from None
    prompt = request.prompt or (tokenizer.decode(prompt_ids, False) if prompt_ids else None)
    n = request.beam_search.beam_width or request.sampling.n or 1  # checked by now
    return RequestOutput(request_id, prompt, prompt_ids,
                         [outputs.get(i) or CompletionOutput(index=i) for i in range(n)], prompt_lps,
                         num_cached_tokens=cached)
