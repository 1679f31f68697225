"""An HTTP request body as a JSON object, or BadBody naming what is wrong with it.

Python's json module takes more than a valid OpenAI body: nesting as deep as the interpreter's
recursion limit (deeper raises RecursionError, not ValueError) and lone UTF-16 surrogates
("\\ud800"), which become Python strings that no protobuf field and no tokenizer can hold. Both
are the client's fault and get 400 here, before any field is read."""
from __future__ import annotations

import json


class BadBody(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def parse_object(data: bytes) -> dict:
    try:
        parsed = json.loads(data)
        # One pass in C that fails exactly where a string holds a lone surrogate.
        json.dumps(parsed, ensure_ascii=False).encode()
    except RecursionError:
        raise BadBody("the body is not valid JSON: it is nested too deeply") from None
    except UnicodeEncodeError:
        path = _surrogate_path(parsed)
        raise BadBody(f"{path or 'the body'}: a string holds a lone UTF-16 surrogate; JSON "
                      "strings must be valid Unicode", path or None) from None
    except ValueError as e:  # UnicodeDecodeError included: the body is not UTF-8
        raise BadBody(f"the body is not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise BadBody("the body must be a JSON object")
    return parsed


def _has_surrogate(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def _surrogate_path(value) -> str:
    """The dotted path of the first string (or key) with a lone surrogate, e.g. messages.0.content.
    Iterative: the body is already known to nest no deeper than json.loads allowed."""
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if _has_surrogate(item):
                return path
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                child_path = f"{path}.{key}" if path else key
                if _has_surrogate(key):
                    return path or "the body"
                stack.append((child_path, child))
        elif isinstance(item, list):
            stack.extend((f"{path}.{i}" if path else str(i), child)
                         for i, child in reversed(list(enumerate(item))))
    return ""
