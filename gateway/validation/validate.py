"""GenerateRequest -> internal AddRequest, or a ValidationError that names the offending field.

Everything the scheduler and workers assume about a request is checked here, once, at the edge:
past this point a bad value would surface as a crash deep inside a batch shared by other users.
Ranges follow vLLM's SamplingParams. Every message starts with the field's path.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Sequence

from gateway.validation import beam_request
from gateway.validation.limits import MAX_N, Limits
from gateway.validation.prompt_tokens import (  # noqa: F401 - tokenize_parts, prompt_offsets: the
    check_ids, prompt_ids, prompt_offsets, tokenize_parts)  # gateway's and tests' import of them
from gateway.validation.structured_check import StructuredError, structured_spec
from gateway.tokenizer import TextTokenizer
from gateway.validation.validation_error import ValidationError
from proto import internal_pb2, pagoda_pb2
from proto.sizes import MAX_LIST, MAX_TEMPERATURE, MAX_TOP_K
from proto.sizes import MAX_PENALTY_INTERNAL as MAX_REPETITION_PENALTY
from structured.spec import Spec

MAX_CACHE_SALT_BYTES = 256
DEFAULT_MAX_TOKENS = 256
MAX_PENALTY = 2.0        # presence and frequency, either sign
MAX_LOGIT_BIAS = 100.0   # either sign
# Ids one Abort may name: what the scheduler takes in one Call (scheduler/message_checks.py) and
# its frame limit counts (proto/sizes.py largest_gateway_message), so a valid Abort always
# arrives; each id is at most --max-request-id-bytes, itself under MAX_ID_BYTES with the
# tenant's prefix (gateway_flags.REQUEST_CEILINGS).
MAX_ABORT_IDS = MAX_LIST


@dataclass(frozen=True)
class Caller:
    """What validation needs to know beyond the request: who sent it and how its answer is read."""
    tenant: str = ""  # the API key's namespace ("" without keys): prefixes the public id
    priorities: tuple[int, int] | None = None  # the tenant's range; None: --max-priority alone
    # The tenant prefixes the cache salt, so no tenant's prefix-cache hits (and their timing)
    # reveal what another sent; False with --shared-prefix-cache.
    salt_by_tenant: bool = True
    whole: bool = False  # answered only once the request has ended (unary Generate, HTTP whole)


@dataclass
class Validated:
    add: internal_pb2.AddRequest
    prompt_token_ids: list[int]  # after truncate_prompt_tokens
    n: int
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # stop strings, like stop ids, must not end a sequence before this many
    skip_special_tokens: bool = True
    return_prompt_token_ids: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    seed: int = 0  # always set: drawn when the client gave none, so every answer can be replayed
    public_id: str = ""  # the client's request_id, else the internal id
    beam: pagoda_pb2.BeamSearchParams | None = None  # n is its beam_width
    spec: Spec | None = None  # structured output: compiled by the caller before it is sent


def check_abort_ids(request_ids: Sequence[str], limits: Limits) -> None:
    """An Abort's ids, counted before any is read."""
    count = len(request_ids)  # the repeated field's length: nothing built yet
    if not count:
        raise ValidationError("request_ids", "request_ids: name at least one request to abort")
    if count > MAX_ABORT_IDS:
        raise ValidationError("request_ids", f"request_ids has {count} ids, at most "
                                             f"{MAX_ABORT_IDS} are allowed in one Abort")
    for i, rid in enumerate(request_ids):
        if not rid or len(rid.encode()) > limits.max_request_id_bytes:
            raise ValidationError(f"request_ids[{i}]", f"request_ids[{i}] must be 1 to "
                                                       f"{limits.max_request_id_bytes} bytes")


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:  # also false for NaN
        raise ValidationError(name, f"{name} must be in [{low:g}, {high:g}], got {value:g}")


def _logit_bias(bias, limits: Limits) -> dict[int, float]:
    name = "sampling.logit_bias"
    if len(bias) > limits.max_logit_bias:
        raise ValidationError(
            name, f"{name} has {len(bias)} entries, at most {limits.max_logit_bias} are allowed")
    out = dict(bias)
    for token_id in sorted(out):  # sorted: the same bad request always names the same entry
        value = out[token_id]
        if token_id >= limits.vocab_size:
            raise ValidationError(
                f"{name}[{token_id}]", f"{name}[{token_id}]: token id {token_id} is out of "
                                       f"range: vocab_size is {limits.vocab_size}")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValidationError(
                f"{name}[{token_id}]", f"{name}[{token_id}] must be in [-{MAX_LOGIT_BIAS:g}, "
                                       f"{MAX_LOGIT_BIAS:g}], got {value:g}")
    return out


def _logprobs(s: pagoda_pb2.SamplingParams, name: str, limits: Limits) -> int | None:
    if not s.HasField(name):
        return None
    value = getattr(s, name)
    if not 0 <= value <= limits.max_logprobs:
        raise ValidationError(f"sampling.{name}", f"sampling.{name} must be in [0, "
                                                  f"{limits.max_logprobs}], got {value}")
    return value


def _sampling(req: pagoda_pb2.GenerateRequest, limits: Limits,
              unary: bool) -> tuple[internal_pb2.SamplingConfig, int]:
    s = req.sampling
    temperature = s.temperature if s.HasField("temperature") else 1.0
    if not 0 <= temperature <= MAX_TEMPERATURE:  # also false for NaN
        raise ValidationError("sampling.temperature", f"sampling.temperature must be in "
                              f"[0, {MAX_TEMPERATURE:g}], got {temperature:g}")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not 0.0 < top_p <= 1.0:  # also false for NaN
        raise ValidationError("sampling.top_p", f"sampling.top_p must be in (0, 1], got {top_p:g}")
    top_k = s.top_k if s.HasField("top_k") else 0
    if not 0 <= top_k <= MAX_TOP_K:
        raise ValidationError("sampling.top_k", f"sampling.top_k must be in [0, {MAX_TOP_K}] "
                              f"(0 = off), got {top_k}")
    n = s.n if s.HasField("n") else 1
    if not 1 <= n <= MAX_N:
        raise ValidationError("sampling.n", f"sampling.n must be between 1 and {MAX_N}, got {n}")
    if unary and n != 1:
        raise ValidationError(
            "sampling.n", f"sampling.n must be 1 for Generate, got {n}: use GenerateStream for n > 1")
    _check_range("sampling.min_p", s.min_p, 0.0, 1.0)
    _check_range("sampling.presence_penalty", s.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
    _check_range("sampling.frequency_penalty", s.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
    repetition = s.repetition_penalty if s.HasField("repetition_penalty") else 1.0
    if not 0 < repetition <= MAX_REPETITION_PENALTY:  # also false for NaN
        raise ValidationError("sampling.repetition_penalty", "sampling.repetition_penalty must be "
                              f"in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), got {repetition:g}")
    config = internal_pb2.SamplingConfig(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=s.min_p,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=repetition, logit_bias=_logit_bias(s.logit_bias, limits),
        # An unseeded request gets a seed too: it is reported back, so any answer can be replayed.
        has_seed=True, seed=s.seed if s.HasField("seed") else secrets.randbits(63))
    for name in ("logprobs", "prompt_logprobs"):
        value = _logprobs(s, name, limits)
        if value is not None:
            setattr(config, name, value)
    return config, n


def _request_id(request_id: str, limits: Limits) -> None:
    size = len(request_id.encode())
    if size > limits.max_request_id_bytes:
        raise ValidationError("request_id", f"request_id is {size} bytes, at most "
                                            f"{limits.max_request_id_bytes} are allowed")
    if not request_id.isprintable():  # it lands in logs, metrics and Abort calls
        raise ValidationError("request_id", f"request_id must be printable (no control "
                                            f"characters), got {request_id[:64]!r}")


def _stopping(stopping: pagoda_pb2.StoppingCriteria, limits: Limits) -> None:
    if len(stopping.stop) > limits.max_stop_strings:
        raise ValidationError("stopping.stop", f"stopping.stop has {len(stopping.stop)} strings, "
                                               f"at most {limits.max_stop_strings} are allowed")
    for i, stop in enumerate(stopping.stop):
        name = f"stopping.stop[{i}]"
        if not stop:
            raise ValidationError(name, f"{name} must not be empty")
        size = len(stop.encode())
        if size > limits.max_stop_string_bytes:
            raise ValidationError(name, f"{name} is {size} bytes, at most "
                                        f"{limits.max_stop_string_bytes} are allowed")
    ids = stopping.stop_token_ids
    if len(ids) > limits.max_stop_token_ids:
        raise ValidationError("stopping.stop_token_ids", f"stopping.stop_token_ids has {len(ids)} "
                                                         f"ids, at most {limits.max_stop_token_ids} are allowed")
    check_ids(ids, limits.vocab_size, "stopping.stop_token_ids")
    if stopping.min_tokens < 0:
        raise ValidationError("stopping.min_tokens",
                              f"stopping.min_tokens must be >= 0, got {stopping.min_tokens}")


def _priority(priority: int, limits: Limits, allowed: tuple[int, int] | None) -> None:
    if abs(priority) > limits.max_priority:
        raise ValidationError("priority", f"priority must be in [-{limits.max_priority}, "
                                          f"{limits.max_priority}], got {priority}")
    if allowed is not None and not allowed[0] <= priority <= allowed[1]:
        raise ValidationError("priority", f"priority must be in [{allowed[0]}, {allowed[1]}] "
                                          f"for this API key, got {priority}")


def _final_only(caller: Caller, stopping: pagoda_pb2.StoppingCriteria,
                s: pagoda_pb2.SamplingParams, search) -> bool:
    """Whether the scheduler may send the tokens with the finish (AddRequest.final_only): when
    nothing reads them step by step. Not with stop strings (the gateway ends the request when
    it sees one) nor with the per-position extras that come in their own messages (logprobs);
    a beam search is whole anyway."""
    return (caller.whole and not stopping.stop and not s.HasField("logprobs")
            and not s.HasField("prompt_logprobs") and search is None)


def validate(req: pagoda_pb2.GenerateRequest, tokenizer: TextTokenizer, limits: Limits,
             internal_id: str, unary: bool = False, caller: Caller = Caller()) -> Validated:
    """The request as the finished AddRequest the scheduler gets (the caller's tenant, salt and
    priority range applied) with what the gateway keeps to answer it; raises ValidationError."""
    # Cheap checks first: a request that fails one is refused before any tokenizing.
    _request_id(req.request_id, limits)
    _priority(req.priority, limits, caller.priorities)
    search = beam_request.beam_params(req)
    if search is None:
        sampling, n = _sampling(req, limits, unary)
    else:
        sampling, n = beam_request.beam_sampling(), search.beam_width
    try:
        spec = structured_spec(req, limits.max_structured_output_bytes)
    except StructuredError as e:
        raise ValidationError(e.field, str(e)) from None
    if spec is not None:
        sampling.structured_output.CopyFrom(req.sampling.structured_output)
    stopping = req.stopping
    _stopping(stopping, limits)
    salt_bytes = len(req.cache_salt.encode())
    if salt_bytes > MAX_CACHE_SALT_BYTES:
        raise ValidationError("cache_salt", f"cache_salt is {salt_bytes} bytes, at most "
                                            f"{MAX_CACHE_SALT_BYTES} are allowed")
    # Tenants are fixed-length prefixes ("k" + 16 hex digits + "/"), so no client salt of one
    # tenant can equal another tenant's salted one.
    salt = caller.tenant + req.cache_salt if caller.salt_by_tenant else req.cache_salt
    final_only = _final_only(caller, stopping, req.sampling, search)
    truncate = req.truncate_prompt_tokens if req.HasField("truncate_prompt_tokens") else None
    if truncate is not None and truncate < 1:
        raise ValidationError("truncate_prompt_tokens",
                              f"truncate_prompt_tokens must be >= 1, got {truncate}")

    source, ids = prompt_ids(req, tokenizer, limits.vocab_size, limits=limits, truncate=truncate)
    truncated = truncate is not None and len(ids) > truncate
    if truncated:
        ids = ids[-truncate:]  # the end of a prompt is what the next token depends on most
    if len(ids) >= limits.max_model_len:
        after = " after truncate_prompt_tokens" if truncate is not None else ""
        raise ValidationError(
            source, f"{source} is {len(ids)} tokens{after}, must be fewer than max_model_len "
                    f"{limits.max_model_len} to leave room for output")
    room = limits.max_model_len - len(ids)
    min_tokens = stopping.min_tokens
    if stopping.HasField("max_tokens"):
        max_tokens = stopping.max_tokens
        if max_tokens < 1:
            raise ValidationError("stopping.max_tokens",
                                  f"stopping.max_tokens must be >= 1, got {max_tokens}")
        if max_tokens > room:
            raise ValidationError(
                "stopping.max_tokens",
                f"stopping.max_tokens: prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = "
                f"{len(ids) + max_tokens} exceeds max_model_len {limits.max_model_len}")
    else:
        # The default grows to honour min_tokens rather than refuse a request that never set it.
        max_tokens = min(max(DEFAULT_MAX_TOKENS, min_tokens), room)
    if min_tokens > max_tokens:
        raise ValidationError("stopping.min_tokens", f"stopping.min_tokens ({min_tokens}) must be "
                                                     f"<= max_tokens ({max_tokens})")
    sampling.min_tokens = min_tokens

    # EOS is not added to stop_token_ids: the scheduler stops on the ids the workers report in
    # WorkerHello.eos_token_ids (unless ignore_eos), one source of truth for what EOS is.
    public_id = req.request_id or internal_id  # the client's; the scheduler's is the tenant's
    add = internal_pb2.AddRequest(
        request_id=internal_id, prompt_token_ids=ids, sampling=sampling, n=1 if search else n,
        max_tokens=max_tokens, ignore_eos=stopping.ignore_eos,
        stop_token_ids=stopping.stop_token_ids, priority=req.priority,
        public_id=caller.tenant + public_id, tenant=caller.tenant, cache_salt=salt,
        beam_search=search, final_only=final_only)
    s = req.sampling
    return Validated(
        add=add, prompt_token_ids=ids, n=n, stop=list(stopping.stop),
        include_stop_str_in_output=stopping.include_stop_str_in_output, min_tokens=min_tokens,
        skip_special_tokens=req.skip_special_tokens if req.HasField("skip_special_tokens") else True,
        return_prompt_token_ids=req.return_prompt_token_ids,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        seed=sampling.seed, public_id=public_id, beam=search, spec=spec)
