"""A chat request (messages, and tools) as its template sees it, rendered, with the spans that
must be tokenized as plain text (gateway/chat/chat_literals.py). The shapes are transformers': an
assistant's tool_calls are [{"id", "type": "function", "function": {"name", "arguments": the
parsed JSON}}] (templates write `arguments | tojson`), tools are OpenAI's tool objects. Every
size is bounded before anything is rendered: rendering a huge input is the cost the bounds
exist to avoid."""
from __future__ import annotations

import json
from typing import Sequence

import jinja2

from gateway.chat.chat_literals import LiteralError, render_with_literals
from gateway.validation.limits import Limits
from gateway.tokenizer import ROLES, TextTokenizer
from gateway.validation.validation_error import ValidationError
from proto import pagoda_pb2


def _json(text: str, name: str, what: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValidationError(name, f"{name} must be {what}: {e}") from None
    except RecursionError:  # not a ValueError: json's own depth limit
        raise ValidationError(name, f"{name} must be {what}: it nests too deeply") from None


def template_messages(messages: Sequence[pagoda_pb2.ChatMessage]) -> list[dict]:
    """ChatMessages as the template expects them, after checking each role."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ValidationError(
                f"messages[{i}].role",
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.role[:64]!r}")
        msg: dict = {"role": m.role, "content": m.content}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise ValidationError(f"messages[{i}].tool_calls",
                                      f"messages[{i}].tool_calls: only assistant messages make "
                                      f"calls, this one is {m.role!r}")
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.name,
                    "arguments": _json(c.arguments or "{}", f"messages[{i}].tool_calls[{j}].arguments",
                                       "JSON (the call's arguments)")}}
                for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def template_tools(tools: Sequence[pagoda_pb2.Tool]) -> list[dict] | None:
    out = []
    for i, t in enumerate(tools):
        if not t.name:
            raise ValidationError(f"tools[{i}].name", f"tools[{i}].name must not be empty")
        function: dict = {"name": t.name}
        if t.description:
            function["description"] = t.description
        params = _json(t.parameters, f"tools[{i}].parameters", "a JSON Schema object") \
            if t.parameters else {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValidationError(f"tools[{i}].parameters", f"tools[{i}].parameters must be a "
                                                            f"JSON Schema object, got {type(params).__name__}")
        function["parameters"] = params
        out.append({"type": "function", "function": function})
    return out or None


# A template writes tool definitions and calls as JSON (tojson), which can be longer than the
# text sent: an escaped control character, a float's digits ("1e15" is 1000000000000000.0),
# a space after each separator. So their strings count twice, and each tool and call counts
# FRAME_CHARS more for the JSON around it; gateway/bounds/grpc_bounds.py relies on both.
JSON_WEIGHT = 2
FRAME_CHARS = 32


def request_chars(req) -> int:
    """The characters every string the request hands the template counts for."""
    chars = 0
    for m in req.messages:
        chars += len(m.content) + len(m.name) + len(m.tool_call_id)
        chars += sum(JSON_WEIGHT * (len(c.id) + len(c.name) + len(c.arguments)) + FRAME_CHARS
                     for c in m.tool_calls)
    return chars + sum(JSON_WEIGHT * (len(t.name) + len(t.description) + len(t.parameters))
                       + FRAME_CHARS for t in req.tools)


def check_sizes(req, limits: "Limits") -> None:
    if len(req.messages) > limits.max_messages:
        raise ValidationError("messages", f"messages: {len(req.messages)} messages, at most "
                                          f"{limits.max_messages} are allowed")
    if len(req.tools) > limits.max_tools:
        raise ValidationError("tools", f"tools: {len(req.tools)} tools, at most "
                                       f"{limits.max_tools} are allowed (--max-tools)")
    calls = sum(len(m.tool_calls) for m in req.messages)
    if calls > limits.max_tool_calls:
        raise ValidationError("messages", f"messages: {calls} tool calls, at most "
                                          f"{limits.max_tool_calls} are allowed (--max-tool-calls)")
    chars = request_chars(req)
    if chars > limits.max_prompt_chars:
        raise ValidationError(
            "messages", f"messages: the messages' content (and tools, which count twice and "
                        f"{FRAME_CHARS} more each) is {chars} characters, more "
                        f"than any prompt that fits max_model_len {limits.max_model_len} "
                        f"({limits.max_prompt_chars} characters at "
                        f"{limits.max_prompt_chars_per_token} per token); refused before tokenizing")


def render_chat_request(req, tokenizer: TextTokenizer, limits: "Limits | None"
                        ) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered prompt, the spans to tokenize as plain text)."""
    if limits is not None:
        check_sizes(req, limits)
    messages, tools = template_messages(req.messages), template_tools(req.tools)
    try:
        return render_with_literals(
            lambda m, t: tokenizer.render_chat(m, tools=t), messages, tools,
            tokenizer.special_texts)
    except RecursionError:  # a schema or arguments about as deep as json.loads takes
        raise ValidationError("messages", "messages: tools or tool calls nest too deeply to "
                                          "render") from None
    except LiteralError as e:
        raise ValidationError("messages", f"messages hold special-token text that cannot be kept "
                                          f"as plain text: {e}; remove the special tokens") from None
    except (jinja2.TemplateError, ValueError, TypeError) as e:
        # Templates reject some conversations on purpose (raise_exception), e.g. roles that do
        # not alternate; that is the client's input, not a server fault.
        raise ValidationError("messages", f"messages: the chat template refused them: {e}") from e
