"""GenerateRequest -> internal AddRequest, or a ValidationError that names the offending field.

Everything the scheduler and workers assume about a request is checked here, once, at the edge:
past this point a bad value would surface as a crash deep inside a batch shared by other users.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import jinja2

from gateway.tokenizer import ROLES, TextTokenizer
from proto import internal_pb2, pagoda_pb2

MAX_N = 16
DEFAULT_MAX_TOKENS = 256


class ValidationError(ValueError):
    """Becomes INVALID_ARGUMENT; str() is the client-facing message and starts with the field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


@dataclass(frozen=True)
class Limits:
    """What the cluster can take; learned from ClusterInfo."""
    max_model_len: int
    vocab_size: int


@dataclass
class Validated:
    add: internal_pb2.AddRequest
    prompt_token_ids: list[int]
    n: int
    stop: list[str] = field(default_factory=list)


def _check_ids(ids: Sequence[int], vocab_size: int, name: str) -> None:
    for i, token_id in enumerate(ids):
        if token_id >= vocab_size:
            raise ValidationError(
                f"{name}[{i}]", f"{name}[{i}] = {token_id} is out of range: vocab_size is {vocab_size}")


def chat_messages(messages: Sequence[pagoda_pb2.ChatMessage]) -> list[dict]:
    """ChatMessages as the template expects them, after checking each role."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ValidationError(
                f"messages[{i}].role",
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.role!r}")
        out.append({"role": m.role, "content": m.content})
    return out


def encode_messages(tokenizer: TextTokenizer, messages: Sequence[pagoda_pb2.ChatMessage]) -> list[int]:
    msgs = chat_messages(messages)
    try:
        return tokenizer.encode_chat(msgs)
    except (jinja2.TemplateError, ValueError) as e:
        # Templates reject some conversations on purpose (raise_exception), e.g. roles that do
        # not alternate; that is the client's input, not a server fault.
        raise ValidationError("messages", f"messages: the chat template refused them: {e}") from e


def prompt_ids(req, tokenizer: TextTokenizer, vocab_size: int) -> tuple[str, list[int]]:
    """(the field the prompt came from, its token ids). Shared by Generate and Tokenize."""
    # TokenizeRequest has no prompt_token_ids; the same rule covers both messages.
    names = [n for n in ("prompt", "prompt_token_ids", "messages") if n in req.DESCRIPTOR.fields_by_name]
    given = [n for n in names if len(getattr(req, n)) > 0]
    allowed = ", ".join(names[:-1]) + " and " + names[-1]
    if not given:
        # proto3 cannot tell an empty prompt or an empty list from an absent one.
        raise ValidationError(
            "prompt", f"exactly one of {allowed} must be set, got none (an empty prompt or "
                      "an empty list counts as none)")
    if len(given) > 1:
        raise ValidationError(given[1], f"exactly one of {allowed} must be set, got {' and '.join(given)}")
    source = given[0]
    if source == "prompt":
        ids = tokenizer.encode(req.prompt)
    elif source == "messages":
        ids = encode_messages(tokenizer, req.messages)
    else:
        ids = list(req.prompt_token_ids)
        _check_ids(ids, vocab_size, "prompt_token_ids")
    if not ids:
        raise ValidationError(source, f"{source} encodes to no tokens")
    return source, ids


def _sampling(req: pagoda_pb2.GenerateRequest, unary: bool) -> tuple[internal_pb2.SamplingConfig, int]:
    s = req.sampling
    temperature = s.temperature if s.HasField("temperature") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        raise ValidationError("sampling.temperature",
                              f"sampling.temperature must be a finite number >= 0, got {temperature:g}")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not 0.0 < top_p <= 1.0:  # also false for NaN
        raise ValidationError("sampling.top_p", f"sampling.top_p must be in (0, 1], got {top_p:g}")
    top_k = s.top_k if s.HasField("top_k") else 0
    if top_k < 0:
        raise ValidationError("sampling.top_k", f"sampling.top_k must be >= 0 (0 = off), got {top_k}")
    n = s.n if s.HasField("n") else 1
    if not 1 <= n <= MAX_N:
        raise ValidationError("sampling.n", f"sampling.n must be between 1 and {MAX_N}, got {n}")
    if unary and n != 1:
        raise ValidationError(
            "sampling.n", f"sampling.n must be 1 for Generate, got {n}: use GenerateStream for n > 1")
    config = internal_pb2.SamplingConfig(
        temperature=temperature, top_p=top_p, top_k=top_k,
        has_seed=s.HasField("seed"), seed=s.seed)
    return config, n


def validate(req: pagoda_pb2.GenerateRequest, tokenizer: TextTokenizer, limits: Limits,
             internal_id: str, unary: bool = False) -> Validated:
    sampling, n = _sampling(req, unary)
    stopping = req.stopping
    for i, stop in enumerate(stopping.stop):
        if not stop:
            raise ValidationError(f"stopping.stop[{i}]", f"stopping.stop[{i}] must not be empty")
    _check_ids(stopping.stop_token_ids, limits.vocab_size, "stopping.stop_token_ids")

    source, ids = prompt_ids(req, tokenizer, limits.vocab_size)
    if len(ids) >= limits.max_model_len:
        raise ValidationError(
            source, f"{source} is {len(ids)} tokens, must be fewer than max_model_len "
                    f"{limits.max_model_len} to leave room for output")
    room = limits.max_model_len - len(ids)
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
        max_tokens = min(DEFAULT_MAX_TOKENS, room)

    # EOS is not added to stop_token_ids: the scheduler stops on the ids the workers report in
    # WorkerHello.eos_token_ids (unless ignore_eos), one source of truth for what EOS is.
    add = internal_pb2.AddRequest(
        request_id=internal_id, prompt_token_ids=ids, sampling=sampling, n=n,
        max_tokens=max_tokens, ignore_eos=stopping.ignore_eos,
        stop_token_ids=stopping.stop_token_ids, priority=req.priority)
    return Validated(add=add, prompt_token_ids=ids, n=n, stop=list(stopping.stop))
