"""tool_choice "required" or a named function, as a grammar: an xgrammar structural tag whose
every call is the hermes format the shipped tool template asks for, `<tool_call>` + {"name":
the function, "arguments": JSON valid against its parameters} + `</tool_call>`, so the answer
always parses (gateway/chat/tool_parsers.py) and its arguments validate. "auto" and "none" need no
grammar: auto is parsed from free text, none is read as plain content."""
from __future__ import annotations

import json

PARSER = "hermes"  # the parser that reads what this grammar lets through, whatever the flag says
BEGIN = '<tool_call>\n{"name": %s, "arguments": '
END = "}\n</tool_call>"


def _tag(function: dict) -> dict:
    return {"type": "tag", "begin": BEGIN % json.dumps(function["name"]),
            # Whitespace in the arguments is bounded: free whitespace is where small models loop.
            "content": {"type": "json_schema", "max_whitespace_cnt": 1,
                        "json_schema": function.get("parameters") or {"type": "object"}},
            "end": END}


def tool_call_tag(functions: list[dict], tool_choice, parallel: bool) -> str | None:
    """The structural tag JSON, or None when tool_choice leaves the text free. functions are
    OpenAI's tools[i].function objects; tool_choice is "required", "auto", "none" or
    {"type": "function", "function": {"name": …}} (already checked against the tools)."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        function = next(f for f in functions if f["name"] == name)
        return json.dumps({"type": "structural_tag", "format": _tag(function)})
    if tool_choice != "required":
        return None
    # Calls only, one or (parallel_tool_calls) more, a newline apart: no free text, which a
    # small model could otherwise ramble in before it calls.
    return json.dumps({"type": "structural_tag", "format": {
        "type": "tags_with_separator", "tags": [_tag(f) for f in functions], "separator": "\n",
        "at_least_one": True, "stop_after_first": not parallel}})
