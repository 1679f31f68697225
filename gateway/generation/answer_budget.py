"""What whole answers keep, bounded in bytes of the gateway's memory: per answer and for the
gateway.

A whole answer (unary Generate, an HTTP answer not streamed) is held until the request ends;
with logprobs every position carries k alternatives, so one answer can hold megabytes, and only
the cluster's sequence count bounded how many were held at once (without logprobs an answer
is its text and ids, a few bytes a token, and is not counted). Each whole request with logprobs
reserves what its answer can grow to (its positions at the most a token can cost, at most
--max-whole-answer-bytes) from the gateway's --max-whole-answers-bytes before it is sent. A
request that does not fit is refused at once with RESOURCE_EXHAUSTED (HTTP 429), as a full
scheduler refuses: waiting for room would hold the client's connection and hide the overload
from its retry policy. An answer that grows past its reservation takes more if the gateway has
it; past --max-whole-answer-bytes it ends with RESOURCE_EXHAUSTED (streamed, it would not be kept).

What is counted is memory, IN_MEMORY bytes per byte the answer serializes to: an answer is kept
as upb messages (gRPC) or dicts (HTTP), not as its wire bytes. Measured against a gateway with the
fake worker, 8,184 tokens with 20 logprobs each (2.7 MB on the wire): four unary Generates at
once grew it 49 MB, four HTTP completions 62 MB, about 4.5 and 5.7 bytes per wire byte.
"""
from __future__ import annotations

from typing import Callable

from gateway.tokenizer import TextTokenizer
from gateway.validation.validate import Validated

_ID = 6           # a tag and a varint of up to 5 bytes
_FLOAT = 5        # a tag and 4 bytes
_FRAME = 4        # a tag and a length, for a string or a message up to 2 MiB
_SCALARS = 4096   # usage, metrics, the request id, a matched stop string
IN_MEMORY = 6     # bytes of the gateway's memory per byte of a kept answer's wire size


def longest_spelling(tokenizer: TextTokenizer) -> int:
    """UTF-8 bytes of the vocabulary's longest spelling: a token's raw bytes are at most that
    (byte-level, Metaspace, byte fallback and added tokens all spell a byte with one or more)."""
    vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    return max((len(t.encode()) for t in vocab), default=16)


def _token_logprob(spelling: int, k: int) -> int:
    """A TokenLogprob: id, logprob, rank, its text (at most 3 bytes per raw byte: U+FFFD) and
    bytes, and k alternatives of id, logprob and text."""
    text = _FRAME + 3 * spelling
    return _FRAME + 2 * _ID + _FLOAT + text + _FRAME + spelling + k * (_FRAME + _ID + _FLOAT + text)


def answer_bytes(spelling: int, positions: int, prompt: int, logprobs: int | None,
                 prompt_logprobs: int | None, echo_prompt: bool) -> int:
    """The most a whole answer of `positions` output tokens (all sequences) can hold."""
    out = positions * (_ID + 3 * spelling + 1 + (_token_logprob(spelling, logprobs)
                                                 if logprobs is not None else 0))
    back = prompt * ((_ID if echo_prompt else 0) + (_token_logprob(spelling, prompt_logprobs)
                                                    if prompt_logprobs is not None else 0))
    return out + back + _SCALARS


class AnswerBudget:
    def __init__(self, per_answer: int, total: int, refuse: Callable[[str], Exception],
                 tokenizer: TextTokenizer):
        self.per_answer = per_answer
        self.total = total
        self.free = total
        self.refuse = refuse  # the exception that ends a request, given its message
        self.spelling = longest_spelling(tokenizer)

    def hold_for(self, v: Validated) -> "Held":
        """A reservation for a validated request's whole answer, or refuse()'s exception."""
        return self.hold(IN_MEMORY * answer_bytes(
            self.spelling, v.add.max_tokens * v.n, len(v.prompt_token_ids), v.logprobs,
            v.prompt_logprobs, v.return_prompt_token_ids))

    def hold(self, need: int) -> "Held":
        held = Held(self)
        held.grow(min(need, self.per_answer))
        return held

    def _take(self, n: int) -> None:
        if n > self.free:
            raise self.refuse(
                f"whole answers on this gateway hold {self.total - self.free} of "
                f"{self.total} bytes (--max-whole-answers-bytes) and this one needs {n} more; "
                "retry later, or stream it")
        self.free -= n


class Held:
    """One request's share of the budget: released once, when the request ends."""

    def __init__(self, budget: AnswerBudget):
        self.budget = budget
        self.held = 0
        self.kept = 0

    def grow(self, n: int) -> None:
        self.budget._take(n)
        self.held += n

    def keep(self, size: int) -> None:
        """size more bytes of the answer (its wire size) are kept."""
        self.kept += IN_MEMORY * size
        if self.kept <= self.held:
            return
        if self.kept > self.budget.per_answer:
            raise self.budget.refuse(
                f"the answer passed {self.budget.per_answer} bytes (--max-whole-answer-bytes); "
                "ask for it streamed (GenerateStream, or stream: true)")
        self.grow(min(self.budget.per_answer, 2 * self.kept) - self.held)

    def release(self) -> None:
        self.budget.free += self.held
        self.held = 0
