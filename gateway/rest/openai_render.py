"""pagoda.v1 GenerateResponses as OpenAI objects: whole responses, stream chunks, logprobs in
both of OpenAI's shapes (chat's `content` list, completions' parallel lists), and usage."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.rest.openai_tools import ToolMode
from gateway.tokenizer import TextTokenizer
from gateway.rest.tool_render import tool_message
from proto import pagoda_pb2

FINISH = {pagoda_pb2.FINISH_REASON_STOP: "stop", pagoda_pb2.FINISH_REASON_LENGTH: "length",
          pagoda_pb2.FINISH_REASON_ABORT: "abort"}


def finish_reason(response: pagoda_pb2.GenerateResponse) -> str | None:
    return FINISH.get(response.finish_reason)


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def chat_logprobs(lps, tokenizer: TextTokenizer) -> list[dict]:
    """Chat's shape: one entry per token with its bytes and its top alternatives."""
    return [{"token": lp.text, "logprob": lp.logprob, "bytes": list(lp.token_bytes),
             "top_logprobs": [{"token": t.text, "logprob": t.logprob,
                               "bytes": list(tokenizer.token_bytes(t.token_id))}
                              for t in lp.top_logprobs]}
            for lp in lps]


@dataclass
class CompletionLogprobs:
    """Completions' shape: parallel lists; text_offset counts characters into the choice's text
    (echoed prompt included), so each entry is placed when its text is known."""
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    offset: int = 0

    def add(self, lps) -> None:
        for lp in lps:
            self._append(lp.text, lp.logprob, {t.text: t.logprob for t in lp.top_logprobs})

    def add_unscored(self, text: str) -> None:
        """The prompt's first token: nothing before it scores it."""
        self._append(text, None, None)

    def _append(self, text: str, logprob: float | None, top: dict | None) -> None:
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def as_dict(self, start: int = 0, stop: int | None = None) -> dict:
        """Entries start:stop."""
        return {"tokens": self.tokens[start:stop], "token_logprobs": self.token_logprobs[start:stop],
                "top_logprobs": self.top_logprobs[start:stop],
                "text_offset": self.text_offset[start:stop]}


@dataclass
class Choice:
    """One choice while its responses arrive."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    chat_logprobs: list[dict] = field(default_factory=list)
    completion_logprobs: CompletionLogprobs | None = None
    completion_tokens: int = 0
    echoed: bool = False  # the echoed prompt went out (streaming)


class Collector:
    """Gathers the responses of one or more generations (a completions batch: one per prompt)
    into whole choices and usage. choice index = prompt index * n + the response's index.

    Completions' echo: the prompt's text comes first in every choice of that prompt; with
    logprobs, its tokens' logprobs too, which arrive with index 0's first response. Responses
    of a prompt's indices interleave in any order, so the echoed part is kept per prompt and
    put in front when a choice is written out."""

    def __init__(self, tokenizer: TextTokenizer, n: int, num_prompts: int, chat: bool,
                 logprobs: bool, echo: list[str] | None = None,
                 tools: ToolMode | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools  # chat with tools: each answer is read for calls
        self.n, self.chat, self.logprobs = n, chat, logprobs
        self.choices = [Choice() for _ in range(n * num_prompts)]
        self.prompt_tokens = [0] * num_prompts
        self.cached_tokens = [0] * num_prompts
        self.echo_text = echo
        self.echo_logprobs: list[CompletionLogprobs | None] = [None] * num_prompts

    def add(self, prompt: int, response: pagoda_pb2.GenerateResponse) -> Choice:
        choice = self.choices[prompt * self.n + response.index]
        if self.echo_text and self.logprobs and response.prompt_token_ids:
            lp = self.echo_logprobs[prompt] = CompletionLogprobs()
            lp.add_unscored(self.tokenizer.token_text(response.prompt_token_ids[0]))
            lp.add(response.prompt_logprobs)
        choice.text += response.text
        choice.token_ids += response.token_ids
        if self.logprobs:
            if self.chat:
                choice.chat_logprobs += chat_logprobs(response.logprobs, self.tokenizer)
            else:
                if choice.completion_logprobs is None:
                    choice.completion_logprobs = CompletionLogprobs(
                        offset=len(self.echo_text[prompt]) if self.echo_text else 0)
                choice.completion_logprobs.add(response.logprobs)
        if response.finish_reason:
            choice.finish_reason = finish_reason(response)
            choice.completion_tokens = response.usage.completion_tokens
            self.prompt_tokens[prompt] = response.usage.prompt_tokens
            self.cached_tokens[prompt] = response.usage.cached_prompt_tokens
        return choice

    def echo_ready(self, prompt: int) -> bool:
        """Whether the prompt's echoed part is complete (its logprobs, where asked, arrived)."""
        return not (self.echo_text and self.logprobs) or self.echo_logprobs[prompt] is not None

    def echo_part(self, prompt: int) -> tuple[str, dict | None]:
        text = self.echo_text[prompt] if self.echo_text else ""
        lp = self.echo_logprobs[prompt]
        return text, lp.as_dict() if lp is not None else None

    def completion_logprobs(self, index: int, start: int = 0, stop: int | None = None) -> dict | None:
        """A completions choice's logprobs, entries start:stop of its own tokens, with the echoed
        prompt's in front when start is 0."""
        c = self.choices[index]
        if not self.logprobs:
            return None
        own = c.completion_logprobs.as_dict(start, stop) if c.completion_logprobs else \
            CompletionLogprobs().as_dict()
        _, echo = self.echo_part(index // self.n)
        if start or echo is None:
            return own
        return {k: echo[k] + own[k] for k in own}

    def usage(self) -> dict:
        return usage(sum(self.prompt_tokens), sum(c.completion_tokens for c in self.choices),
                     sum(self.cached_tokens))

    def response(self, rid: str, model: str, created: int) -> dict:
        if self.chat:
            choices = []
            for i, c in enumerate(self.choices):
                message, finish = ({"role": "assistant", "content": c.text}, c.finish_reason) \
                    if self.tools is None else tool_message(c.text, c.finish_reason, self.tools)
                choices.append({"index": i, "message": message, "finish_reason": finish,
                                "logprobs": {"content": c.chat_logprobs} if self.logprobs else None})
            kind = "chat.completion"
        else:
            choices = [{"index": i, "text": self.echo_part(i // self.n)[0] + c.text,
                        "finish_reason": c.finish_reason,
                        "logprobs": self.completion_logprobs(i)}
                       for i, c in enumerate(self.choices)]
            kind = "text_completion"
        return {"id": rid, "object": kind, "created": created, "model": model,
                "choices": choices, "usage": self.usage()}


def chunk(rid: str, model: str, created: int, chat: bool, choices: list[dict],
          usage_: dict | None = None) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def chat_delta(index: int, content: str | None, logprobs: list[dict] | None, finish: str | None,
               role: bool = False) -> dict:
    delta: dict = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    return {"index": index, "delta": delta,
            "logprobs": {"content": logprobs} if logprobs is not None else None,
            "finish_reason": finish}


def now() -> int:
    return int(time.time())
