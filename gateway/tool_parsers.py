"""Tool-call parsers (--tool-call-parser): the model's text in, OpenAI's tool calls out. One small
interface, a registry by name; hermes-style (`<tool_call>{"name": …, "arguments": …}</tool_call>`,
what the shipped ChatML tool template asks for, and what tool_choice "required" or a named
function enforce through a grammar) is the first.

A parser streams: feed() takes each text delta and returns what can be said so far (content and
tool-call fragments, as OpenAI streams them: a call's id and name first, then its arguments);
finish() returns what was held back at the end. A whole answer is parsed by the same steps, so
a streamed answer always reassembles into the whole one. Whitespace next to a call (the
newlines between calls, around them) is not content; a block that is not a JSON object with a
string name stays content, as written."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class Parsed:
    content: str          # text outside any call ("" when there is none)
    calls: list[ToolCall]


@dataclass
class Fragment:
    """A streamed piece: content text, or a part of call `index` (id and name once, then
    arguments)."""
    content: str = ""
    index: int = -1
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ToolParser:
    """The interface: feed() / finish() as above; parse() is them over a whole answer."""

    def feed(self, delta: str) -> list[Fragment]:
        raise NotImplementedError

    def finish(self) -> list[Fragment]:
        raise NotImplementedError

    def parse(self, text: str) -> Parsed:
        frags = self.feed(text) + self.finish()
        calls: dict[int, ToolCall] = {}
        for f in frags:
            if f.index < 0:
                continue
            if f.name is not None:
                calls[f.index] = ToolCall(f.name, "", f.id)
            calls[f.index].arguments += f.arguments
        return Parsed("".join(f.content for f in frags if f.index < 0),
                      [calls[i] for i in sorted(calls)])


class HermesParser(ToolParser):
    BEGIN, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""   # text not yet said: a possible start of a tag, or an open call
        self._space = ""    # whitespace held: content if text follows, dropped if a call does
        self._calls = 0

    def feed(self, delta: str) -> list[Fragment]:
        self._buffer += delta
        out: list[Fragment] = []
        while True:
            start = self._buffer.find(self.BEGIN)
            if start < 0:
                # Hold back a tail that could be the start of "<tool_call>".
                keep = _partial_suffix(self._buffer, self.BEGIN)
                cut = len(self._buffer) - keep
                self._content(self._buffer[:cut], out)
                self._buffer = self._buffer[cut:]
                return out
            self._content(self._buffer[:start], out)
            self._buffer = self._buffer[start:]
            end = self._buffer.find(self.END)
            if end < 0:
                return out  # an open call: said whole once it closes
            block, self._buffer = self._buffer[:end + len(self.END)], self._buffer[end + len(self.END):]
            call = _call(block[len(self.BEGIN):-len(self.END)].strip())
            if call is None:
                self._content(block, out)
                continue
            self._space = ""
            i = self._calls
            self._calls += 1
            out.append(Fragment(index=i, id=call.id, name=call.name))
            out.append(Fragment(index=i, arguments=call.arguments))

    def finish(self) -> list[Fragment]:
        out: list[Fragment] = []
        rest, self._buffer = self._buffer, ""
        self._content(rest, out)  # a tag's start, or a call that never closed: text
        if self._space and not self._calls:
            out.append(Fragment(content=self._space))
        self._space = ""
        return out

    def _content(self, text: str, out: list[Fragment]) -> None:
        kept = text.rstrip()
        if not kept:
            self._space += text
            return
        out.append(Fragment(content=self._space + kept))
        self._space = text[len(kept):]

    @property
    def called(self) -> bool:
        return self._calls > 0


def _call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser}


def parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}") from None
