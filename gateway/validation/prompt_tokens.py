"""A request's prompt as token ids: which field holds it, its text rendered (chat) and encoded in
pieces within the context (piece_encoding.py), and Tokenize's answer from the same path."""
from __future__ import annotations

from array import array
from typing import Sequence

from gateway.chat.chat_render import render_chat_request
from gateway.piece_encoding import TooManyTokens
from gateway.tokenizer import TextTokenizer
from gateway.validation.limits import Limits
from gateway.validation.validation_error import ValidationError
from proto import pagoda_pb2


def check_ids(ids: Sequence[int], vocab_size: int, name: str) -> None:
    # max() runs in C: a long, valid list (the common case) costs no Python loop.
    if not ids or max(ids) < vocab_size:
        return
    for i, token_id in enumerate(ids):
        if token_id >= vocab_size:
            raise ValidationError(
                f"{name}[{i}]", f"{name}[{i}] = {token_id} is out of range: vocab_size is {vocab_size}")


def _source(req) -> str:
    # TokenizeRequest has no prompt_token_ids; the same rule covers both messages.
    names = [n for n in ("prompt", "prompt_token_ids", "messages") if n in req.DESCRIPTOR.fields_by_name]
    given = [n for n in names if len(getattr(req, n)) > 0]
    allowed = ", ".join(names[:-1]) + " and " + names[-1]
    if not given:
        # proto3 cannot tell an empty prompt or an empty list from an absent one.
        raise ValidationError(
            "prompt", f"prompt: exactly one of {allowed} must be set, got none (an empty prompt "
                      "or an empty list counts as none)")
    if len(given) > 1:
        raise ValidationError(
            given[1], f"{given[1]}: exactly one of {allowed} must be set, got {' and '.join(given)}")
    return given[0]


def _prompt_text(req, source: str, tokenizer: TextTokenizer, limits: Limits | None
                 ) -> tuple[str, list[tuple[int, int]]]:
    """The text to tokenize (the prompt, or the rendered chat) and the spans of it to tokenize
    as plain text (gateway/chat/chat_literals.py). Size bounds come first, because tokenizing or
    rendering a huge input is itself the cost they exist to avoid."""
    if source == "messages":
        return render_chat_request(req, tokenizer, limits)
    if len(req.tools):
        raise ValidationError("tools", "tools: only messages are rendered with tools (by the "
                                       f"chat template), this request sends {source}")
    if limits is not None and len(req.prompt) > limits.max_prompt_chars:
        raise ValidationError(
            source, f"{source}: {source} is {len(req.prompt)} characters, more than any prompt "
                    f"that fits max_model_len {limits.max_model_len} ({limits.max_prompt_chars} "
                    f"characters at {limits.max_prompt_chars_per_token} per token); refused "
                    "before tokenizing")
    return req.prompt, []


def _add_special(req, source: str, add_special_tokens: bool | None) -> bool:
    # A chat template writes every special token it wants itself (as transformers does with
    # tokenize=True), so by default the post-processor adds no BOS of its own to messages.
    if add_special_tokens is not None:
        return add_special_tokens
    if "add_special_tokens" in req.DESCRIPTOR.fields_by_name and req.HasField("add_special_tokens"):
        return req.add_special_tokens
    return source != "messages"


def prompt_ids(req, tokenizer: TextTokenizer, vocab_size: int, *,
               add_special_tokens: bool | None = None,
               limits: Limits | None = None, truncate: int | None = None) -> tuple[str, list[int]]:
    """(the field the prompt came from, its token ids). Shared by Generate and Tokenize.

    add_special_tokens: None = the request's own field where it has one (TokenizeRequest), else
    True for a prompt and False for messages. limits: also bound the message count, the
    prompt's characters and its ids before tokenizing or building anything. truncate: the
    request's truncate_prompt_tokens, which lets in more ids than fit (as many as characters)."""
    source = _source(req)
    if source == "prompt_token_ids":
        if len(req.tools):
            raise ValidationError("tools", "tools: only messages are rendered with tools (by the "
                                           "chat template), this request sends prompt_token_ids")
        if limits is not None:
            _count_ids(len(req.prompt_token_ids), limits, truncate)  # the field's length: O(1)
        ids = list(req.prompt_token_ids)
        check_ids(ids, vocab_size, "prompt_token_ids")
    else:
        text, literal = _prompt_text(req, source, tokenizer, limits)
        add = _add_special(req, source, add_special_tokens)
        if limits is not None:
            ids = _encode_bounded(source, text, add, literal, tokenizer, limits, truncate)
        elif literal:
            ids = tokenizer.encode_with_offsets(text, add, literal)[0]
        else:
            ids = tokenizer.encode(text, add_special_tokens=add)
    if not ids:
        raise ValidationError(source, f"{source} encodes to no tokens")
    return source, ids


def _encode_bounded(source: str, text: str, add: bool, literal: Sequence[tuple[int, int]],
                    tokenizer: TextTokenizer, limits: Limits, truncate: int | None) -> list[int]:
    """A prompt's ids, encoding stopped as soon as they cannot fit the context (piece_encoding.py:
    a million-token prompt never becomes one Encoding); with truncate_prompt_tokens all of them."""
    most = limits.max_model_len - 1 if truncate is None else limits.max_prompt_chars * 4
    try:
        ids, _ = tokenizer.encode_bounded(text, add, most, literal)
    except TooManyTokens:
        raise ValidationError(
            source, f"{source} is more than {most} tokens, must be fewer than max_model_len "
                    f"{limits.max_model_len} to leave room for output") from None
    return ids[-truncate:].tolist() if truncate is not None else ids.tolist()


def tokenize_parts(req: pagoda_pb2.TokenizeRequest, tokenizer: TextTokenizer, limits: Limits
                   ) -> tuple[str, array, array]:
    """Tokenize's answer as prompt_offsets gives it, in arrays (offsets: start and end per id,
    interleaved), at most limits.max_tokenize_tokens of them (INVALID_ARGUMENT past it)."""
    source = _source(req)
    text, literal = _prompt_text(req, source, tokenizer, limits)
    add = _add_special(req, source, None)
    most = limits.max_tokenize_tokens
    try:
        ids, offsets = tokenizer.encode_bounded(text, add, most, literal)
    except TooManyTokens:
        raise ValidationError(
            source, f"{source} is more than {most} tokens, the most a Tokenize answer holds "
                    f"(max_model_len {limits.max_model_len} x {limits.max_tokenize_contexts}, "
                    "--max-tokenize-contexts)") from None
    if not ids:
        raise ValidationError(source, f"{source} encodes to no tokens")
    return text, ids, offsets


def _count_ids(count: int, limits: Limits, truncate: int | None) -> None:
    """prompt_token_ids' count against the context, before they become a list (a 16 MiB message
    holds millions: a list of them costs 36 bytes and the loop's time each)."""
    if truncate is None and count >= limits.max_model_len:
        raise ValidationError(
            "prompt_token_ids", f"prompt_token_ids is {count} tokens, must be fewer than "
                                f"max_model_len {limits.max_model_len} to leave room for output")
    if count > limits.max_prompt_chars:
        raise ValidationError(
            "prompt_token_ids", f"prompt_token_ids has {count} ids, more than "
                                f"{limits.max_prompt_chars} (max_model_len {limits.max_model_len} "
                                f"x {limits.max_prompt_chars_per_token}, as a prompt's "
                                "characters) even with truncate_prompt_tokens")


def prompt_offsets(req: pagoda_pb2.TokenizeRequest, tokenizer: TextTokenizer, *,
                   limits: Limits | None = None) -> tuple[str, list[int], list[tuple[int, int]]]:
    """Tokenize's answer: (the text tokenized, its ids, each id's code-point span in the text)."""
    source = _source(req)
    text, literal = _prompt_text(req, source, tokenizer, limits)
    ids, offsets = tokenizer.encode_with_offsets(text, _add_special(req, source, None), literal)
    if not ids:
        raise ValidationError(source, f"{source} encodes to no tokens")
    return text, ids, offsets
