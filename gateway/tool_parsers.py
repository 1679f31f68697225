"""Tool-call parsers (--tool-call-parser): the model's text in, OpenAI's tool calls out. One small
interface, a registry by name; hermes-style (`<tool_call>{"name": …, "arguments": …}</tool_call>`,
what the shipped ChatML tool template asks for, and what tool_choice "required" or a named
function enforce through a grammar) is the first.

Streaming: feed() takes each text delta and returns what can be said so far (content and
tool-call fragments, as OpenAI streams them: a call's id, type and name first, then its
arguments); finish() returns what was held back at the end."""
from __future__ import annotations

import json
import re
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
    """A streamed piece: content text, or a part of call `index` (name once, then arguments)."""
    content: str = ""
    index: int = -1
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class HermesParser:
    BEGIN, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str) -> Parsed:
        """The whole answer. A block that is not a JSON object with a string name stays content."""
        calls, kept, last = [], [], 0
        for m in self._CALL.finditer(text):
            call = _call(m.group(1))
            if call is None:
                continue
            kept.append(text[last:m.start()])
            last = m.end()
            calls.append(call)
        kept.append(text[last:])
        content = "".join(kept).strip() if calls else text
        return Parsed(content, calls)

    # ---------------------------------------------------------------- streaming

    def __init__(self) -> None:
        self._buffer = ""   # text not yet said: a possible start of a tag, or an open call
        self._calls = 0

    def feed(self, delta: str) -> list[Fragment]:
        self._buffer += delta
        out: list[Fragment] = []
        while True:
            start = self._buffer.find(self.BEGIN)
            if start < 0:
                # Hold back a tail that could be the start of "<tool_call>".
                keep = _partial_suffix(self._buffer, self.BEGIN)
                text, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                if text:
                    out.append(Fragment(content=text))
                return out
            if start:
                out.append(Fragment(content=self._buffer[:start]))
                self._buffer = self._buffer[start:]
            end = self._buffer.find(self.END)
            if end < 0:
                return out  # an open call: said whole once it closes
            block, self._buffer = self._buffer[:end + len(self.END)], self._buffer[end + len(self.END):]
            call = _call(block[len(self.BEGIN):-len(self.END)].strip())
            if call is None:
                out.append(Fragment(content=block))
                continue
            i = self._calls
            self._calls += 1
            out.append(Fragment(index=i, id=call.id, name=call.name))
            out.append(Fragment(index=i, arguments=call.arguments))

    def finish(self) -> list[Fragment]:
        rest, self._buffer = self._buffer, ""
        return [Fragment(content=rest)] if rest else []

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


PARSERS = {"hermes": HermesParser}


def parser(name: str):
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}") from None
