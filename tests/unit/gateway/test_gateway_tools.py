"""Tool calls: the hermes parser, whole and streamed in any cut; the answer in OpenAI's shape
(gateway/rest/tool_render.py), whole and as stream chunks the `openai` SDK's own accumulator
reassembles; and the grammar that tool_choice "required" / a named function compile to
(xgrammar, the real vocabulary): every answer walked under it parses, names a given function,
and its arguments validate. Two walks per choice keep this module at a few seconds."""
from __future__ import annotations

import json

import jsonschema
import openai
from openai.lib.streaming.chat import ChatCompletionStreamState
import pytest

from gateway.rest.http_stream import _tool_choices
from gateway.rest.openai_render import chunk
from gateway.rest.openai_tools import ToolMode
from gateway.chat.tool_grammar import tool_call_tag
from gateway.chat.tool_parsers import HermesParser, parser
from gateway.rest.tool_render import ToolStream, tool_message
from tests.unit.worker.test_worker_grammar import cache, config, tok, walk  # noqa: F401 - fixtures
from proto import pagoda_pb2 as pb
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
    assert content == whole.content
    assert names == [c.name for c in whole.calls]
    assert [args[i] for i in range(len(args))] == [c.arguments for c in whole.calls]
    # No fragment ever carries a partial "<tool_call" as content.
    assert all("<tool" not in f.content for f in frags)
    # Arguments go out as they come: in small cuts, each call's in more than one piece.
    pieces = [sum(1 for f in frags if f.index == i and f.arguments) for i in range(len(args))]
    if cut <= 5:
        assert all(n > 1 for n in pieces), pieces
    if cut >= len(TEXT):
        assert pieces == [1, 1]


@pytest.mark.parametrize("text, arguments", [
    ('<tool_call>{"name": "f", "arguments": {"s": "}\\"]{</tool_call>", "t": [1, {"u": 2}]}}</tool_call>',
     '{"s": "}\\"]{</tool_call>", "t": [1, {"u": 2}]}'),  # brackets, quotes and the end tag in strings
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', '{"a": 1}'),  # a string argument
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', '{"a": 1}'),  # keys the other way
    ('<tool_call>{"name": "f", "arguments": {"a": [1, 2', '{"a": [1, 2'),  # cut: what came stands
])
def test_arguments_are_the_model_s_own_text_streamed_or_whole(text, arguments):
    for cut in (1, 3, len(text)):
        p = parser("hermes")
        frags = [f for i in range(0, len(text), cut) for f in p.feed(text[i:i + cut])] + p.finish()
        assert [f.name for f in frags if f.name] == ["f"]
        assert "".join(f.arguments for f in frags) == arguments
        assert not "".join(f.content for f in frags)


@pytest.mark.parametrize("choice, parallel", [
    ("required", False), ("required", True),
    ({"type": "function", "function": {"name": "get_time"}}, False)])
def test_required_and_named_choices_always_give_valid_calls(tok, cache, choice, parallel):
    spec = Spec("structural_tag", tool_call_tag([WEATHER, TIME], choice, parallel))
    schemas = {f["name"]: f["parameters"] for f in (WEATHER, TIME)}
    for seed in range(2):
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


@pytest.mark.parametrize("text, content, names", [
    ("plain  text \n", "plain  text \n", []),  # no call: the text as written
    ("\n" + TEXT.split("Let me check.")[1] + "\n\n", "", ["get_weather", "get_time"]),
    ("A <tool_call>{\"name\": \"f\"}</tool_call>\n B ", "A\n B", ["f"]),
    ("<tool_call>{\"name\": \"f\", \"arguments\": {\"x\"", "", ["f"]),  # its head came: a call
    ("<tool_call>{\"name\": \"f\", \"argu", '<tool_call>{"name": "f", "argu', []),  # no head: text
    ("a <tool_c", "a <tool_c", []),
])
def test_whitespace_next_to_a_call_is_not_content(text, content, names):
    parsed = HermesParser().parse(text)
    assert (parsed.content, [c.name for c in parsed.calls]) == (content, names)


def chunks_of(text: str, mode: ToolMode, cut: int, finish: str = "stop") -> list[dict]:
    """The stream of one choice, as gateway/rest/http_stream.py sends it, in pieces of `cut`."""
    stream, out = ToolStream(mode), [{"index": 0, "delta": {"role": "assistant", "content": ""}}]
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    for k, piece in enumerate(pieces):
        deltas = stream.deltas(piece)
        if k == len(pieces) - 1:
            more, finish = stream.finish(finish)
            deltas += more
        out += [{"index": 0, "delta": d, "finish_reason": None} for d in deltas]
    out.append({"index": 0, "delta": {}, "finish_reason": finish})
    return [chunk("id", "m", 0, True, [c]) for c in out]


@pytest.mark.parametrize("cut", [1, 4, 1000])
@pytest.mark.parametrize("mode", [ToolMode("hermes"), ToolMode("hermes", parallel=False),
                                  ToolMode("hermes", named="get_time"), ToolMode(None)],
                         ids=["auto", "one-call", "named", "none"])
def test_streamed_chunks_reassemble_in_the_sdk_into_the_whole_message(cut, mode):
    message, finish = tool_message(TEXT, "stop", mode)
    state = ChatCompletionStreamState()
    for c in chunks_of(TEXT, mode, cut):
        state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate(c))
    got = state.get_final_completion().choices[0]
    # OpenAI's: a named function's answer finishes "stop", as one without calls does.
    assert got.finish_reason == finish == ("stop" if mode.named or mode.parser is None else "tool_calls")
    assert got.message.content == message["content"]
    got_calls = got.message.tool_calls or []
    assert [(c.type, c.function.name, c.function.arguments) for c in got_calls] == [
        (c["type"], c["function"]["name"], c["function"]["arguments"])
        for c in message.get("tool_calls", [])]
    assert len({c.id for c in got_calls}) == len(got_calls) and all(
        c.id.startswith("call_") for c in got_calls)
    if mode.parser is None:
        assert message == {"role": "assistant", "content": TEXT}
    else:
        assert message["content"] == "Let me check."
        assert len(message["tool_calls"]) == (2 if mode.parallel else 1)


def test_a_call_cut_by_max_tokens_keeps_what_came_and_finishes_length():
    cut = TEXT[:TEXT.index('"unit"')]  # OpenAI's: a cut call's arguments as far as they came
    message, finish = tool_message(cut, "length", ToolMode("hermes"))
    assert finish == "length" and message["content"] == "Let me check."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Paris", ')]
    no_head = TEXT[:TEXT.index('"arguments"')]
    message, finish = tool_message(no_head, "length", ToolMode("hermes"))
    assert (message, finish) == ({"role": "assistant", "content": no_head}, "length")
    first = TEXT[:TEXT.index("</tool_call>") + len("</tool_call>")]
    message, finish = tool_message(first + "\n<tool", "length", ToolMode("hermes"))
    assert finish == "length" and [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_a_streamed_response_s_logprobs_ride_its_first_delta_and_the_finish_its_own():
    stream = ToolStream(ToolMode("hermes"))
    lps = [{"token": "x", "logprob": -1.0, "bytes": [120], "top_logprobs": []}]
    held = _tool_choices(0, stream, pb.GenerateResponse(text="<tool"), lps)
    assert held == [{"index": 0, "delta": {}, "logprobs": {"content": lps}, "finish_reason": None}]
    last = _tool_choices(0, stream, pb.GenerateResponse(
        text='_call>{"name": "f"}</tool_call>', finish_reason=pb.FINISH_REASON_STOP), None)
    assert [c["delta"] for c in last] == [
        {"tool_calls": [{"index": 0, "id": last[0]["delta"]["tool_calls"][0]["id"],
                         "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, {}]
    assert [c["finish_reason"] for c in last] == [None, None, "tool_calls"]
