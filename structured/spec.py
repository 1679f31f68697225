"""What a request asks its output to match, as it travels (proto StructuredOutput), and how it
becomes an xgrammar grammar. One spec kind per request; every kind is compiled by xgrammar
(no hand-written schema-to-regex code)."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


class SpecError(ValueError):
    """A spec the compiler refuses; the message names the reason, the caller names the field."""


@dataclass(frozen=True)
class Spec:
    kind: str                   # one of KINDS
    value: str = ""             # the schema / regex / grammar / structural tag text
    choices: tuple[str, ...] = ()
    any_whitespace: bool = False  # JSON: free whitespace between tokens (small models loop on it)

    def key(self) -> str:
        """Cache key: equal specs compile to the same grammar."""
        text = json.dumps([self.kind, self.value, list(self.choices), self.any_whitespace])
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def size(self) -> int:
        return len(self.value.encode()) + sum(len(c.encode()) for c in self.choices)

    @classmethod
    def from_proto(cls, msg) -> "Spec | None":
        """From a pagoda.v1.StructuredOutput; None when it names no kind."""
        kind = msg.WhichOneof("kind")
        if kind is None:
            return None
        if kind == "choice":
            return cls("choice", choices=tuple(msg.choice.values), any_whitespace=msg.any_whitespace)
        if kind == "json_object":
            return cls("json_object", any_whitespace=msg.any_whitespace)
        return cls(kind, getattr(msg, kind), any_whitespace=msg.any_whitespace)

    def to_proto(self, msg) -> None:
        """Fills a pagoda.v1.StructuredOutput."""
        msg.any_whitespace = self.any_whitespace
        if self.kind == "choice":
            msg.choice.values.extend(self.choices)
        elif self.kind == "json_object":
            msg.json_object = True
        else:
            setattr(msg, self.kind, self.value)

    def compile(self, compiler):
        """An xgrammar CompiledGrammar; SpecError with the compiler's reason."""
        try:
            if self.kind == "json_schema":
                return compiler.compile_json_schema(self.value, any_whitespace=self.any_whitespace,
                                                    strict_mode=True)
            if self.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}',
                                                    any_whitespace=self.any_whitespace)
            if self.kind == "regex":
                return compiler.compile_regex(self.value)
            if self.kind == "choice":
                return compiler.compile_regex("|".join(_regex_literal(c) for c in self.choices))
            if self.kind == "grammar":
                return compiler.compile_grammar(self.value)
            if self.kind == "structural_tag":
                return compiler.compile_structural_tag(self.value)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors are these
            why = _first_line(e)
            if self.kind != "grammar":
                # A regex (a pattern too) is translated into a grammar first, and some of its
                # errors point into that translation, a line and column the client never wrote.
                why = _GRAMMAR_POSITION.sub("", why)
            raise SpecError(why) from None
        raise SpecError(f"unknown kind {self.kind!r}")


def _regex_literal(text: str) -> str:
    """A regex matching exactly text (xgrammar's regex dialect is ECMAScript's)."""
    return "".join("\\" + c if c in "\\^$.|?*+()[]{}/-" else c for c in text)


_ASSERTION = re.compile(r"^Check failed: \(.*?\) is false: ")
_GRAMMAR_POSITION = re.compile(r"^EBNF (parser|lexer) error at line \d+, column \d+: ")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    # xgrammar prefixes its messages with "[time] /project/cpp/file.cc:line: "
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1] if ".cc:" in text.split(": ", 1)[0] else text
    text = text.splitlines()[0] if text else type(e).__name__
    # and its assertions with the C++ condition: "Check failed: (val >= ...) is false: why"
    text = _ASSERTION.sub("", text)
    return text[:500]
