"""Long text encoded in pieces, with a bound on its tokens, so that no Encoding for more than a
piece is ever alive.

tokenizers' Encoding keeps about 160 bytes per token (ids, type ids, masks, offsets, the token
strings), and a prompt of a million characters of U+10FFFF is four million tokens: encoded whole,
one request held 330 MB of the gateway before its length was compared with anything. Here the
text is encoded a piece of about PIECE_CHARS characters at a time, the ids and offsets kept in
arrays of 4 bytes each, and encoding stops as soon as the tokens pass the caller's bound.

A piece ends where the tokenizer certainly splits: at a boundary its own pre-tokenizer puts in
two windows around the wanted cut that start at different places (regex pre-tokenizers resync
within a few characters, so a boundary both agree on is one the whole text has too), outside
any added token's text (those are split out before pre-tokenizing). A run with no such boundary
(a "word" of a million U+10FFFF, which the byte-level regex keeps as one pre-token) is cut inside
with an overlap: the tokens of the last OVERLAP_CHARS characters of each part are dropped and
encoded again at the start of the next, from the start of the first token dropped, so each token
kept had the same context to its left and OVERLAP_CHARS to its right as in the whole word.

Whether a tokenizer's pieces equal its whole-text encoding is checked once on a sample of the
hard cases (tests/unit/gateway/test_piece_encoding.py has more); one whose normalizer or
pre-tokenizer marks the start of a text (Llama's legacy Prepend("▁")) fails it and is encoded
whole, bounded by --max-large-input-bytes alone.
"""
from __future__ import annotations

import re
from array import array

from tokenizers import Tokenizer

PIECE_CHARS = 2048
WINDOW_CHARS = 256    # each side of a wanted cut, for the pre-tokenizer's boundaries
OVERLAP_CHARS = 256   # re-encoded at a cut inside a run without boundaries
# Texts up to this many characters are encoded whole: their Encoding is small.
WHOLE_UP_TO = 2 * PIECE_CHARS


class TooManyTokens(Exception):
    def __init__(self, count: int):
        super().__init__(f"more than {count} tokens")
        self.count = count  # tokens counted when encoding stopped: more than the bound


class PieceEncoder:
    """encode(text) -> (ids, offsets): array('I') of ids, and one of start and end code points
    per id, interleaved, equal to the Encoding of the whole text."""

    def __init__(self, tokenizer: Tokenizer, piece_chars: int = PIECE_CHARS,
                 window_chars: int = WINDOW_CHARS, overlap_chars: int = OVERLAP_CHARS):
        self.tok = tokenizer
        self.piece_chars, self.window, self.overlap = piece_chars, window_chars, overlap_chars
        added = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values() if t.content),
                       key=len, reverse=True)
        self._added_texts = added
        self._added = re.compile("|".join(map(re.escape, added))) if added else None
        self._specials: tuple[list, list, list, list] | None = None
        self._exact: bool | None = None

    @property
    def exact(self) -> bool:
        """Whether pieces encode as the whole text does, on a sample of the hard cases."""
        if self._exact is None:
            self._exact = True  # for the check itself
            sample = _SAMPLE + " x".join(self._added_texts[:8])
            small = PieceEncoder(self.tok, piece_chars=200, window_chars=32, overlap_chars=OVERLAP_CHARS)
            small._exact = True
            whole = self.tok.encode(sample, add_special_tokens=True)
            ids, offsets = small.encode(sample, True, 1 << 30, whole_up_to=0)
            self._exact = (list(ids) == whole.ids
                           and list(zip(offsets[::2], offsets[1::2])) == whole.offsets)
        return self._exact

    def encode(self, text: str, add_special_tokens: bool, max_tokens: int,
               whole_up_to: int = WHOLE_UP_TO) -> tuple[array, array]:
        """Raises TooManyTokens past max_tokens."""
        ids, offsets = array("I"), array("I")
        if len(text) <= whole_up_to or not self.exact:
            enc = self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
            _check(len(enc.ids), max_tokens)
            ids.extend(enc.ids)
            offsets.extend(x for pair in enc.offsets for x in pair)
            return ids, offsets
        prefix, prefix_at, suffix, suffix_at = self._special_tokens() if add_special_tokens else ([],) * 4
        ids.extend(prefix)
        offsets.extend(prefix_at)
        start = 0
        while start < len(text):
            end, overlap = self._cut(text, start)
            while True:
                enc = self.tok.encode_batch([text[start:end]], add_special_tokens=False)[0]
                part_ids, part_offsets = enc.ids, enc.offsets  # each property builds a new list
                del enc
                keep = len(part_ids)
                if not overlap:
                    break
                # Drop the tokens ending in the overlap; the next part starts at them.
                limit = end - start - self.overlap
                while keep and part_offsets[keep - 1][1] > limit:
                    keep -= 1
                if keep:
                    end = start + part_offsets[keep - 1][1]
                    break
                # One token (a word-level model's [UNK]) spans the part: a longer one.
                end, overlap = min(len(text), end + self.piece_chars), end + self.piece_chars < len(text)
            _check(len(ids) + keep, max_tokens)
            ids.extend(part_ids[:keep])
            offsets.extend(start + x for pair in part_offsets[:keep] for x in pair)
            start = end
        _check(len(ids) + len(suffix), max_tokens)
        ids.extend(suffix)
        offsets.extend(suffix_at)
        return ids, offsets

    def _cut(self, text: str, start: int) -> tuple[int, bool]:
        """Where the piece from start ends, and whether that is a cut inside a run (overlap)."""
        want = start + self.piece_chars
        if want + self.window >= len(text):
            return len(text), False
        cut = self._boundary(text, start, want)
        if cut is not None:
            return cut, False
        return want + self.overlap, True

    def _boundary(self, text: str, start: int, at: int) -> int | None:
        """A boundary near `at` the whole text's pre-tokenizing certainly has, or None."""
        lo, hi = max(start, at - self.window), at + self.window
        first = self._boundaries(text, lo, hi)
        second = self._boundaries(text, (lo + at) // 2, hi)
        inside = self._inside_added(text, lo, hi)
        # Away from both windows' edges, where a pre-token may be cut short.
        both = sorted((b for b in first & second
                       if (lo + at) // 2 < b < hi - self.window // 4 and b > start and b not in inside),
                      key=lambda b: abs(b - at))
        for b in both[:8]:
            # The text cut there pre-tokenizes as the whole does on both sides: lookaheads
            # (GPT-2's \s+(?!\S) takes "\r\n" whole at the end of a text, not before a word)
            # see the end of a piece.
            if (self._boundaries(text, lo, b) == {x for x in first if x < b}
                    and self._boundaries(text, b, hi) == {x for x in first if x >= b}):
                return b
        return None

    def _boundaries(self, text: str, lo: int, hi: int) -> set[int]:
        window = text[lo:hi]
        if self.tok.normalizer is not None:
            window = self.tok.normalizer.normalize_str(window)
            if len(window) != hi - lo:  # offsets would no longer be the text's
                return set()
        pre = self.tok.pre_tokenizer
        if pre is None:
            return set()
        return {lo + s for _, (s, _) in pre.pre_tokenize_str(window)}

    def _inside_added(self, text: str, lo: int, hi: int) -> set[int]:
        """Positions that would cut an added token's text (or the whitespace it may strip)."""
        if self._added is None:
            return set()
        out: set[int] = set()
        margin = 64
        for m in self._added.finditer(text, max(0, lo - margin), hi + margin):
            a, b = m.start(), m.end()
            while a > 0 and text[a - 1].isspace() and m.start() - a < margin:
                a -= 1
            while b < len(text) and text[b].isspace() and b - m.end() < margin:
                b += 1
            out.update(range(a, b + 1))
        return out

    def _special_tokens(self) -> tuple[list, list, list, list]:
        """The ids and offsets the post-processor adds before and after a text's tokens."""
        if self._specials is None:
            bare = self.tok.encode("a", add_special_tokens=False)
            full = self.tok.encode("a", add_special_tokens=True)
            n = len(bare.ids)
            at = next(i for i in range(len(full.ids) - n + 1) if full.ids[i:i + n] == bare.ids)
            flat = lambda pairs: [x for p in pairs for x in p]  # noqa: E731
            self._specials = (full.ids[:at], flat(full.offsets[:at]),
                              full.ids[at + n:], flat(full.offsets[at + n:]))
        return self._specials


def _check(count: int, max_tokens: int) -> None:
    if count > max_tokens:
        raise TooManyTokens(count)


# The hard cases for cutting: whitespace runs, CRLF, digits, emoji with joiners, noncharacters
# and the last code point, a run with no pre-token boundary, words of every script.
_SAMPLE = ("Hello  world\r\n\r\n  12345678901234567890 don't 'll\t\tx "
           + "\U0010ffff" * 290 + " 👩‍👩‍👧‍👦🏳️‍🌈 " + "=" * 301 + " 漢字かなカナ한국어" * 5
           + "   \n\n\n   end" + "a" * 80 + " " + "line\r\n" * 40 + "x \n\n" * 40)
