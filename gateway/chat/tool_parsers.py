"""Tool-call parsers (--tool-call-parser): the model's text in, OpenAI's tool calls out. One small
interface, a registry by name; hermes-style (`<tool_call>{"name": …, "arguments": …}</tool_call>`,
what the shipped ChatML tool template asks for, and what tool_choice "required" or a named
function enforce through a grammar) is the first.

A parser streams: feed() takes each text delta and returns what can be said so far (content and
tool-call fragments, as OpenAI streams them: a call's id and name first, then its arguments);
finish() returns what was held back at the end. A whole answer is parsed by the same steps, so
a streamed answer always reassembles into the whole one. Whitespace next to a call (the
newlines between calls, around them) is not content; a block that never says a call's head and
is not a JSON object with a string name stays content, as written."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from gateway import json_nesting


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=_call_id)


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
    """Streams a call's arguments as the model writes them once its head is out: `{"name": "f",
    "arguments": ` (what the template and the forced grammar write) says the id and name, then
    each piece of an object or array argument goes out as it comes, its raw text, up to its
    closing bracket. A call whose head is written otherwise (keys in another order, a string
    argument) is said whole once it closes. Once its name is out a call stands, as vLLM's and
    OpenAI's do: an answer cut by max_tokens keeps what came of the arguments."""
    BEGIN, END = "<tool_call>", "</tool_call>"
    HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:')

    def __init__(self) -> None:
        self._buffer = ""   # text not yet said: a possible start of a tag, or an open call
        self._space = ""    # whitespace held: content if text follows, dropped if a call does
        self._calls = 0
        self._state = "text"  # text | head (an open call) | args (streaming) | tail (to END)
        self._depth = 0       # of the streaming argument's brackets
        self._in_string = self._escape = False

    def feed(self, delta: str) -> list[Fragment]:
        self._buffer += delta
        out: list[Fragment] = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list[Fragment]) -> bool:
        """Say what the buffer allows in the current state; True when the state changed."""
        if self._state == "text":
            start = self._buffer.find(self.BEGIN)
            if start < 0:
                # Hold back a tail that could be the start of "<tool_call>".
                cut = len(self._buffer) - _partial_suffix(self._buffer, self.BEGIN)
                self._content(self._buffer[:cut], out)
                self._buffer = self._buffer[cut:]
                return False
            self._content(self._buffer[:start], out)
            self._buffer, self._state = self._buffer[start + len(self.BEGIN):], "head"
            return True
        if self._state == "head":
            head = self.HEAD.match(self._buffer)
            if head is not None:
                self._open(json.loads(head.group(1)), out)
                self._buffer, self._state = self._buffer[head.end():], "args"
                return True
            end = self._buffer.find(self.END)
            if end < 0:
                return False  # an open call: said once its head is known, or whole at its end
            body, self._buffer = self._buffer[:end], self._buffer[end + len(self.END):]
            self._state = "text"
            call = _call(body.strip())
            if call is None:
                self._content(self.BEGIN + body + self.END, out)
            else:
                self._open(call.name, out, call.id)
                out.append(Fragment(index=self._calls - 1, arguments=call.arguments))
            return True
        if self._state == "args":
            return self._arguments(out)
        end = self._buffer.find(self.END)  # tail: what follows the argument, up to the end tag
        if end < 0:
            self._buffer = self._buffer[len(self._buffer) - _partial_suffix(self._buffer, self.END):]
            return False
        self._buffer, self._state = self._buffer[end + len(self.END):], "text"
        return True

    def _arguments(self, out: list[Fragment]) -> bool:
        text = self._buffer.lstrip() if self._depth == 0 else self._buffer
        if not text:
            self._buffer = ""
            return False
        if self._depth == 0 and text[0] not in "{[":
            end = text.find(self.END)  # a string or other scalar: said whole at the end tag
            if end < 0:
                self._buffer = text
                return False
            out.append(Fragment(index=self._calls - 1, arguments=_scalar(text[:end])))
            self._buffer, self._state = text[end + len(self.END):], "text"
            return True
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    out.append(Fragment(index=self._calls - 1, arguments=text[:i + 1]))
                    self._buffer, self._state = text[i + 1:], "tail"
                    return True
        out.append(Fragment(index=self._calls - 1, arguments=text))
        self._buffer = ""
        return False

    def _open(self, name: str, out: list[Fragment], call_id: str | None = None) -> None:
        self._space = ""
        out.append(Fragment(index=self._calls, id=call_id or _call_id(), name=name))
        self._calls += 1

    def finish(self) -> list[Fragment]:
        out: list[Fragment] = []
        rest, self._buffer = self._buffer, ""
        if self._state == "head":
            rest = self.BEGIN + rest  # a call that never said its head: text
        if self._state in ("text", "head"):
            self._content(rest, out)  # a tag's start, or a call that never closed
        elif self._state == "args" and self._depth == 0 and rest.strip():
            out.append(Fragment(index=self._calls - 1, arguments=rest.strip()))
        self._state = "text"
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
        obj = json_nesting.loads(body)  # TooDeep is a ValueError: such a call is text
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _scalar(text: str) -> str:
    """A string argument's JSON text (what it holds), or another scalar's as written; the outer
    object's closing brace dropped."""
    text = text.strip()
    text = text[:-1].rstrip() if text.endswith("}") else text
    try:
        value = json_nesting.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, str) else text


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
