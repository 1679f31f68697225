"""Which chat template renders a request: --chat-template (vLLM's flag: a file, or the template
itself inline) over the model's own, and the shipped tool-aware ChatML template
(gateway/chat/templates/chatml_tools.jinja) for requests with tools or tool calls when the active
template never reads `tools`, as SmolLM2's does not. vLLM makes the user pass such a template;
falling back to one that speaks the hermes format the parser reads keeps function calling
working on any ChatML model without a flag."""
from __future__ import annotations

import codecs
from pathlib import Path
from typing import Sequence

import jinja2
import jinja2.meta

TOOLS_TEMPLATE = Path(__file__).resolve().parent / "templates" / "chatml_tools.jinja"
# What vLLM takes as the sign of an inline template rather than a path.
_JINJA_CHARS = "{}\n"


class TemplateFlagError(ValueError):
    pass


def read_chat_template(value: str) -> str:
    """--chat-template's text: the file it names, else the value itself when it looks like a
    template (vLLM's rule: it holds `{`, `}` or a newline; escapes such as \\n are read)."""
    path = Path(value).expanduser()
    try:
        text = path.read_text()
    except (OSError, ValueError) as e:
        if not any(c in value for c in _JINJA_CHARS):
            raise TemplateFlagError(f"{value!r} looks like a file path, but it cannot be "
                                    f"read: {e}") from None
        # backslashreplace keeps characters beyond Latin-1 intact through unicode_escape.
        text = codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateFlagError(f"not a valid Jinja template (line {e.lineno}: {e.message})") from None
    return text


def reads_tools(env: jinja2.Environment, source: str) -> bool:
    """Whether the template uses the `tools` variable at all."""
    return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))


def wants_tools(messages: Sequence[dict], tools) -> bool:
    """A request the tool-aware template is for: tools offered, or calls in the turns. A tool
    result alone is a turn any ChatML template writes (as transformers renders it)."""
    return bool(tools) or any(m.get("tool_calls") for m in messages)
