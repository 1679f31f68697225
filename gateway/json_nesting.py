"""JSON text from a client or a model, parsed only when it nests no deeper than MAX_JSON_DEPTH.

Python's json raises RecursionError (not ValueError) near the interpreter's recursion limit, and
what sits at depth 900 still costs every later walker (the grammar compiler, a template's
tojson, json.dumps) a deep recursion of its own. No schema, tool call or structured output needs
more than a few dozen levels, so deeper text is refused before it is parsed, by a scan in C: the
strings cut out by one regex, then the brackets' running sum in numpy.
"""
from __future__ import annotations

import json
import re

import numpy as np

MAX_JSON_DEPTH = 128

# A JSON string: quotes around anything but a quote or backslash, or an escape. An unclosed
# string is left in, so its brackets count too: that only overestimates invalid JSON.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_OPEN, _CLOSE = np.zeros(128, np.int8), np.zeros(128, np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_CLOSE[[ord("]"), ord("}")]] = 1


class TooDeep(ValueError):
    """A ValueError, so callers that refuse invalid JSON refuse this the same way."""


def nesting_depth(text: str | bytes) -> int:
    """The deepest run of open brackets outside strings (0 for a scalar)."""
    if isinstance(text, str):
        text = text.encode("utf-8", "surrogatepass")
    if b"[" not in text and b"{" not in text:
        return 0
    bare = np.frombuffer(_STRING.sub(b"", text) if b'"' in text else text, np.uint8)
    bare = bare[bare < 128]  # brackets are ASCII; any multi-byte character is none of them
    steps = _OPEN[bare].astype(np.int32) - _CLOSE[bare]
    return int(np.cumsum(steps).max(initial=0))


def loads(text: str | bytes, max_depth: int = MAX_JSON_DEPTH):
    """json.loads, or TooDeep past max_depth levels (or past what json itself takes)."""
    depth = nesting_depth(text)
    if depth > max_depth:
        raise TooDeep(f"it nests {depth} levels deep, at most {max_depth} are allowed")
    try:
        return json.loads(text)
    except RecursionError:  # a backstop: the scan above refuses anything this deep
        raise TooDeep(f"it nests deeper than {max_depth} levels") from None


def dumps(value, **kwargs) -> str:
    """json.dumps of a parsed value (an HTTP body's), or TooDeep where it nests past what the
    encoder's recursion takes."""
    try:
        return json.dumps(value, **kwargs)
    except RecursionError:
        raise TooDeep("it nests too deeply") from None
