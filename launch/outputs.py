"""The offline API's types, named and shaped as vLLM's: SamplingParams in, RequestOutput out
(launch/offline.py runs them)."""
from __future__ import annotations

import time
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from proto import pagoda_pb2 as pb

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
          pb.FINISH_REASON_ABORT: "abort"}


@dataclass
class SamplingParams:
    """vLLM's defaults: temperature 1, top_p 1, top_k 0 (off), max_tokens 16."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0


@dataclass
class BeamSearchParams:
    """vLLM's, for LLM.beam_search, plus transformers' early_stopping ("true", "false", "never")."""
    beam_width: int
    max_tokens: int = 16
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: str = "false"
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    priority: int = 0


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


def generate_request(fields: dict, p: SamplingParams | BeamSearchParams) -> pb.GenerateRequest:
    if isinstance(p, BeamSearchParams):
        req = pb.GenerateRequest(
            beam_search=pb.BeamSearchParams(beam_width=p.beam_width, length_penalty=p.length_penalty,
                                            early_stopping=p.early_stopping),
            stopping=pb.StoppingCriteria(max_tokens=p.max_tokens, ignore_eos=p.ignore_eos,
                                         stop_token_ids=p.stop_token_ids or []),
            priority=p.priority, skip_special_tokens=p.skip_special_tokens,
            return_prompt_token_ids=True)
        return _with_prompt(req, fields)
    s = pb.SamplingParams(
        n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias or {})
    if p.seed is not None:
        s.seed = p.seed
    if p.logprobs is not None:
        s.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        s.prompt_logprobs = p.prompt_logprobs
    stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
    stopping = pb.StoppingCriteria(stop=stop, stop_token_ids=p.stop_token_ids or [],
                                   ignore_eos=p.ignore_eos, min_tokens=p.min_tokens,
                                   include_stop_str_in_output=p.include_stop_str_in_output)
    if p.max_tokens is not None:
        stopping.max_tokens = p.max_tokens
    req = pb.GenerateRequest(sampling=s, stopping=stopping, priority=p.priority,
                             skip_special_tokens=p.skip_special_tokens,
                             return_prompt_token_ids=True)
    if p.truncate_prompt_tokens is not None:
        req.truncate_prompt_tokens = p.truncate_prompt_tokens
    return _with_prompt(req, fields)


def _with_prompt(req: pb.GenerateRequest, fields: dict) -> pb.GenerateRequest:
    if "prompt" in fields:
        req.prompt = fields["prompt"]
    elif "prompt_token_ids" in fields:
        req.prompt_token_ids.extend(fields["prompt_token_ids"])
    else:
        for m in fields["messages"]:
            req.messages.add(role=m["role"], content=m["content"])
    return req


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
    from gateway.server import RpcFailed

    n = request.beam_search.beam_width or request.sampling.n or 1
    outputs = [CompletionOutput(index=i) for i in range(n)]
    prompt_ids: list[int] = []
    prompt_lps = None
    cached = 0
    try:
        async with aclosing(servicer.responses(request, time.monotonic(), unary=False)) as responses:
            async for r in responses:
                out = outputs[r.index]
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
    return RequestOutput(request_id, prompt, prompt_ids, outputs, prompt_lps,
                         num_cached_tokens=cached)
