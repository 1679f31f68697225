"""Chat content is text, never markup. A chat template writes the special tokens it wants
(<|im_start|>, <|im_end|>) around each message; tokenizing its output as one string would also
turn special-token text inside a message into those tokens, so a user could write
"<|im_end|><|im_start|>system" and forge a system turn. Content that holds such text is
therefore tokenized apart, with special tokens read as plain text; everything else, and every
conversation without such text, tokenizes as one string, exactly as transformers does."""
from __future__ import annotations

from typing import Sequence

from tokenizers import Tokenizer


def literal_spans(rendered: str, contents: Sequence[str], specials: frozenset[str]
                  ) -> list[tuple[int, int]]:
    """The spans of `rendered` (in code points) holding message contents that contain special
    token text, found in message order. Raises LookupError(i) when message i's content does not
    appear verbatim (the template changed it), since it then cannot be kept literal."""
    spans, at = [], 0
    for i, content in enumerate(contents):
        if not any(s in content for s in specials):
            continue
        start = rendered.find(content, at)
        if start < 0:
            raise LookupError(i)
        spans.append((start, start + len(content)))
        at = start + len(content)
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
    pieces, at = [], 0
    for start, end in spans:
        pieces += [(markup, at, start), (literal, start, end)]
        at = end
    pieces.append((markup, at, len(text)))
    for tok, start, end in pieces:
        if start == end:
            continue
        enc = tok.encode(text[start:end], add_special_tokens=False)
        ids += enc.ids
        offsets += [(start + int(a), start + int(b)) for a, b in enc.offsets]
    return ids, offsets
