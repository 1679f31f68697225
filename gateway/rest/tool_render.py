"""A chat answer with tools, in OpenAI's shape: `message.tool_calls` [{id, type "function",
function {name, arguments}}] with `content` the text outside the calls (null when none) and
finish_reason "tool_calls"; streamed, `delta.tool_calls` fragments as OpenAI sends them (a
call's index, id, type and name with arguments "", then its arguments). finish_reason stays
"stop" for a named tool_choice, and "length" for an answer max_tokens cut, as OpenAI's and
vLLM's do. Each choice is read on its own."""
from __future__ import annotations

from gateway.rest.openai_tools import ToolMode
from gateway.chat.tool_parsers import Fragment, ToolCall, parser


def _finish(finish: str | None, called: bool, mode: ToolMode) -> str | None:
    return "tool_calls" if called and finish == "stop" and mode.named is None else finish


def _call(c: ToolCall) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def tool_message(text: str, finish: str | None, mode: ToolMode) -> tuple[dict, str | None]:
    """A whole choice's message and finish_reason."""
    if mode.parser is None:
        return {"role": "assistant", "content": text}, finish
    parsed = parser(mode.parser).parse(text)
    calls = parsed.calls if mode.parallel else parsed.calls[:1]
    if not calls:
        return {"role": "assistant", "content": text}, finish
    return ({"role": "assistant", "content": parsed.content or None,
             "tool_calls": [_call(c) for c in calls]}, _finish(finish, True, mode))


class ToolStream:
    """One streamed choice: its text deltas in, chat deltas out."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.parser = parser(mode.parser) if mode.parser is not None else None
        self.called = False

    def deltas(self, text: str) -> list[dict]:
        if self.parser is None:
            return [{"content": text}] if text else []
        return self._deltas(self.parser.feed(text))

    def finish(self, finish: str) -> tuple[list[dict], str]:
        """What was held back, and the choice's finish_reason."""
        out = self._deltas(self.parser.finish()) if self.parser is not None else []
        return out, _finish(finish, self.called, self.mode)

    def _deltas(self, frags: list[Fragment]) -> list[dict]:
        out = []
        for f in frags:
            if f.index < 0:
                if f.content:
                    out.append({"content": f.content})
                continue
            if f.index > 0 and not self.mode.parallel:
                continue  # parallel_tool_calls false: the first call only
            self.called = True
            if f.name is not None:
                out.append({"tool_calls": [{"index": f.index, "id": f.id, "type": "function",
                                            "function": {"name": f.name, "arguments": ""}}]})
            elif f.arguments:
                out.append({"tool_calls": [{"index": f.index,
                                            "function": {"arguments": f.arguments}}]})
        return out
