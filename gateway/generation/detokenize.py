"""Incremental detokenization of one output sequence, with stop strings.

Two rules make streamed text safe to show as it arrives:
- a chunk never ends inside a multi-byte character (DecodeStream holds tokens back until their
  bytes form whole characters), and
- text that could be the start of a stop string is held back until the next tokens show whether
  the stop string follows; when it does, the output ends just before it.
"""
from __future__ import annotations

import os
from typing import Sequence

from tokenizers.decoders import DecodeStream

from gateway.tokenizer import TextTokenizer

# Prompt tokens fed to the stream as context: tokenizers whose decoders strip a leading space
# (sentencepiece's Metaspace) need the prompt before them to decode the first output token right.
PROMPT_CONTEXT = 4
REPLACEMENT = "\ufffd"


class StopMatcher:
    """Finds stop strings in text that arrives in pieces and says how much text is safe to emit."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self._held = ""  # text received but not emitted: it may begin a stop string
        self.matched: str | None = None

    def feed(self, text: str, active: bool = True) -> str:
        """Returns the text that can be emitted now. After a match, returns the text before it
        (with the stop string itself when include_stop) and sets `matched`; anything fed after
        that is ignored. While not active (min_tokens not reached) nothing matches, but a
        possible start is still held back: a stop string that completes once active counts, as
        in vLLM."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        # Emitted text never held a possible stop start (see _possible_start), so the earliest
        # match lies wholly inside buf.
        first = None
        for stop in self.stops if active else ():
            i = buf.find(stop)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, stop)
        if first is not None:
            self._held = ""
            self.matched = first[1]
            return buf[:first[0] + (len(first[1]) if self.include_stop else 0)]
        keep = self._possible_start(buf)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def _possible_start(self, buf: str) -> int:
        # The longest suffix of buf that is a proper prefix of some stop string.
        for length in range(min(len(buf), max(map(len, self.stops)) - 1), 0, -1):
            tail = buf[-length:]
            if any(s.startswith(tail) for s in self.stops):
                return length
        return 0

    def flush(self) -> str:
        """At the end of the sequence the held text is no longer a possible stop: release it."""
        held, self._held = self._held, ""
        return held if self.matched is None else ""


class Detokenizer:
    """Token ids in, text deltas out, for one sequence (one index of one request)."""

    def __init__(self, tokenizer: TextTokenizer, stop: Sequence[str] = (),
                 prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 include_stop: bool = False, min_tokens: int = 0):
        self._tok = tokenizer
        self._min_tokens = min_tokens  # stop strings count only from this many output tokens on
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT:])
        if context and self._decode(context).endswith(REPLACEMENT):
            context = []  # a prompt cut inside a character would corrupt the first output chunk
        self._stream = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)
        self._ids = context       # context + output ids, for the final flush
        self._decoded = len(context)  # ids before this index have produced their text
        self.stop = StopMatcher(stop, include_stop)
        self.token_ids: list[int] = []  # output ids, up to and including a stop match

    @property
    def stopped(self) -> bool:
        return self.stop.matched is not None

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Feed one sampled token; returns the text to emit now (often "", never a split char).
        Tokens arriving after a stop string matched are dropped."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        self._ids.append(token_id)
        chunk = self._stream.step(self._tok.tokenizer, token_id)
        if chunk is None:
            return ""
        self._decoded = len(self._ids)
        return self.stop.feed(chunk, active=len(self.token_ids) >= self._min_tokens)

    def add_many(self, token_ids: Sequence[int]) -> tuple[str, list[int]]:
        """Feed a delta; returns (text, the ids accepted), which stops short after a stop match."""
        start = len(self.token_ids)
        text = "".join(self.add(t) for t in token_ids if not self.stopped)
        return text, self.token_ids[start:]

    def finish(self) -> str:
        """The sequence ended: emit what was held back. Bytes that never formed a whole character
        come out as U+FFFD, exactly as a full decode would show them."""
        if self.stopped:
            return ""
        text = ""
        if self._decoded < len(self._ids):
            # Decode the leftover tokens with a little context, as DecodeStream would have.
            lo = max(0, self._decoded - PROMPT_CONTEXT)
            before = self._decode(self._ids[lo:self._decoded])
            after = self._decode(self._ids[lo:])
            text = after[len(os.path.commonprefix([before, after])):]
            self._decoded = len(self._ids)
        return self.stop.feed(text, active=len(self.token_ids) >= self._min_tokens) + self.stop.flush()
