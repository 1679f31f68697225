"""Tool calls: the hermes parser, whole and streamed in any cut, and the grammar that
tool_choice "required" / a named function compile to (xgrammar, the real vocabulary): every
answer walked under it parses, names a given function, and its arguments validate."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from gateway.tool_grammar import tool_call_tag
from gateway.tool_parsers import HermesParser, parser
from tests.test_worker_grammar import cache, config, tok, walk  # noqa: F401 - fixtures
from structured.spec import Spec

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}}}}
TIME = {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "string", "maxLength": 8}}}}
TEXT = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "c"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": '
        '"CET"}}</tool_call>')


def test_whole_answers_parse_into_calls_and_content():
    parsed = HermesParser().parse(TEXT)
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in parsed.calls}) == 2
    broken = "<tool_call>{not json}</tool_call>"
    assert HermesParser().parse(broken).content == broken and not HermesParser().parse(broken).calls


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 11, 1000])
def test_streamed_in_any_cut_says_the_same(cut):
    p = parser("hermes")
    frags = [f for i in range(0, len(TEXT), cut) for f in p.feed(TEXT[i:i + cut])] + p.finish()
    content = "".join(f.content for f in frags if f.index < 0)
    names = [f.name for f in frags if f.name]
    args = {}
    for f in frags:
        if f.index >= 0:
            args[f.index] = args.get(f.index, "") + f.arguments
    whole = HermesParser().parse(TEXT)
    assert content.strip() == whole.content
    assert names == [c.name for c in whole.calls]
    assert [args[i] for i in range(len(args))] == [c.arguments for c in whole.calls]
    # No fragment ever carries a partial "<tool_call" as content.
    assert all("<tool" not in f.content for f in frags)


@pytest.mark.parametrize("choice, parallel", [
    ("required", False), ("required", True),
    ({"type": "function", "function": {"name": "get_time"}}, False)])
def test_required_and_named_choices_always_give_valid_calls(tok, cache, choice, parallel):
    spec = Spec("structural_tag", tool_call_tag([WEATHER, TIME], choice, parallel))
    schemas = {f["name"]: f["parameters"] for f in (WEATHER, TIME)}
    for seed in range(3):
        out, end = walk(cache, config(spec, 1.0, seed=seed), seed, limit=400)
        calls = HermesParser().parse(tok.decode(out)).calls
        assert end == 2 and calls, tok.decode(out)
        if isinstance(choice, dict):
            assert [c.name for c in calls] == ["get_time"]
        if not parallel:
            assert len(calls) == 1
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])


def test_auto_and_none_need_no_grammar():
    assert tool_call_tag([WEATHER], "auto", True) is None
    assert tool_call_tag([WEATHER], "none", True) is None
