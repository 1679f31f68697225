"""Chat content is text, never markup. A chat template writes the special tokens it wants
(<|im_start|>, <|im_end|>) around each message; tokenizing its output as one string would also
turn special-token text inside a message into those tokens, so a user could write
"<|im_end|><|im_start|>system" and forge a system turn. The same holds for every string a
request hands the template: tool results, tool-call arguments, function names and
descriptions, JSON Schema keys.

So a conversation where any such string holds special-token text is rendered with that text
swapped for sentinels (noncharacters, which no template filter changes, and which survive
tojson), and swapped back after; then only the special tokens the template wrote itself are
markup, and everything between them is tokenized with special tokens read as plain text. A
conversation without such text (nearly all) is rendered and tokenized as one string, exactly as
transformers does."""
from __future__ import annotations

import functools
import re
from typing import Callable, Sequence

from tokenizers import Tokenizer

# Unicode's noncharacters are reserved for a program's internal use: a sentinel is
# MARK + chr(_INDEX + i) + MARK for special text i, with a MARK no string of the request holds.
_MARKS = [chr(c) for c in range(0xFDD0, 0xFDF0)]
_INDEX = 0xF0000  # plane 15, private use: one character per special text


class LiteralError(ValueError):
    """The template cut a sentinel: the special text it stood for cannot be placed."""


@functools.lru_cache(maxsize=8)
def _pattern(specials: frozenset[str]) -> tuple[re.Pattern, list[str]]:
    ordered = sorted(specials, key=lambda t: (-len(t), t))  # the longest first: "<a><b>" ⊃ "<a>"
    return re.compile("|".join(map(re.escape, ordered))), ordered


def _strings(value, out: list[str]) -> list[str]:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _strings(k, out)
            _strings(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _strings(v, out)
    return out


def _swap(value, sub: Callable[[str], str]):
    if isinstance(value, str):
        return sub(value)
    if isinstance(value, dict):
        return {_swap(k, sub): _swap(v, sub) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_swap(v, sub) for v in value]
    return value


def render_with_literals(render: Callable[[list, list | None], str], messages: list[dict],
                         tools: list[dict] | None, specials: frozenset[str]
                         ) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered prompt, the spans of it, in code points, to tokenize with special tokens
    as plain text). No spans: tokenize it as one string. Raises LiteralError."""
    if not specials:
        return render(messages, tools), []
    pattern, ordered = _pattern(specials)
    strings = _strings(tools, _strings(messages, []))
    if not any(pattern.search(s) for s in strings):
        return render(messages, tools), []
    used = set().union(*(set(s) & set(_MARKS) for s in strings))
    mark = next((m for m in _MARKS if m not in used), None)
    if mark is None:
        raise LiteralError("the request holds every Unicode noncharacter U+FDD0..U+FDEF")
    index = {t: i for i, t in enumerate(ordered)}

    def sub(s: str) -> str:
        return pattern.sub(lambda m: f"{mark}{chr(_INDEX + index[m.group()])}{mark}", s)

    rendered = render(_swap(messages, sub), _swap(tools, sub) if tools else tools)
    # The template's own special tokens are markup; every sentinel goes back to its text.
    token = re.compile(f"{re.escape(mark)}(.){re.escape(mark)}|{pattern.pattern}", re.S)
    pieces, markup, at, length = [], [], 0, 0
    for m in token.finditer(rendered):
        pieces.append(rendered[at:m.start()])
        length += m.start() - at
        if m.group(1) is not None:
            i = ord(m.group(1)) - _INDEX
            if not 0 <= i < len(ordered):
                raise LiteralError("the chat template changed special-token text of the request")
            text = ordered[i]
        else:
            text = m.group()
            markup.append((length, length + len(text)))
        pieces.append(text)
        length += len(text)
        at = m.end()
    pieces.append(rendered[at:])
    text = "".join(pieces)
    if mark in text:
        raise LiteralError("the chat template cut special-token text of the request")
    return text, _between(markup, len(text))


def literal_segments(spans: Sequence[tuple[int, int]], length: int) -> list[tuple[bool, int, int]]:
    """(whether it is a literal span, start, end) for each non-empty part of a text of `length`
    code points, in order."""
    out, at = [], 0
    for start, end in spans:
        out += [(False, at, start), (True, start, end)]
        at = end
    out.append((False, at, length))
    return [part for part in out if part[1] < part[2]]


def _between(markup: Sequence[tuple[int, int]], end: int) -> list[tuple[int, int]]:
    spans, at = [], 0
    for a, b in markup:
        if a > at:
            spans.append((at, a))
        at = b
    if end > at:
        spans.append((at, end))
    return spans


def encode_with_literals(markup: Tokenizer, literal: Tokenizer, text: str,
                         spans: Sequence[tuple[int, int]], add_special_tokens: bool
                         ) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and code-point offsets of text, its spans tokenized by `literal` (special tokens as
    plain text) and the rest by `markup`."""
    if not spans:
        enc = markup.encode(text, add_special_tokens=add_special_tokens)
        return enc.ids, [(int(a), int(b)) for a, b in enc.offsets]
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    for is_literal, start, end in literal_segments(spans, len(text)):
        tok = literal if is_literal else markup
        enc = tok.encode(text[start:end], add_special_tokens=False)
        ids += enc.ids
        offsets += [(start + int(a), start + int(b)) for a, b in enc.offsets]
    return ids, offsets
