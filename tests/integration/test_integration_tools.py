"""Function calling on the real stack with the real model (SmolLM2, whose own template has no
tools: the shipped ChatML tool template renders them) through the real `openai` client:
tool_choice "required" and a named function are enforced by the grammar, so every call's
arguments parse and validate against the function's parameters (jsonschema); a greedy streamed
answer streams its arguments in pieces that reassemble in the SDK into the whole one; a conversation with an assistant's calls and
the tool's results is rendered (the prompt /tokenize counts for it holds the result) and
answered."""
from __future__ import annotations

import json

import jsonschema
import openai
from openai.lib.streaming.chat import ChatCompletionStreamState
import pytest

from tests.tool_calls import after_a_call, rendered


pytestmark = pytest.mark.integration

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "The current weather in a city.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description":
                                           "The time in a time zone.", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


def valid_calls(message) -> list[str]:
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)
    return [c.function.name for c in message.tool_calls]


def test_required_calls_validate_and_stream_in_pieces_into_the_whole(client, model):
    kw = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
              tool_choice="required", parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and not whole.message.content, whole.message
    assert len(valid_calls(whole.message)) == 1
    chunks = list(client.chat.completions.create(**kw, stream=True))
    pieces = [d.function.arguments for ch in chunks for c in ch.choices
              for d in c.delta.tool_calls or [] if d.function.arguments]
    assert len(pieces) > 3, pieces  # the arguments as they come, not whole at the end
    state = ChatCompletionStreamState()  # the SDK's own accumulator reassembles the deltas
    for ch in chunks:
        state.handle_chunk(ch)
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and not streamed.message.content
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_named_calls_sampled_n2_each_validate(client, model):
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0.9, seed=3, n=2,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert len(r.choices) == 2
    for c in r.choices:  # OpenAI's: a named function's answer finishes "stop"
        assert c.finish_reason == "stop" and not c.message.content, c.message
        assert valid_calls(c.message) == ["get_time"]


def test_a_conversation_with_calls_and_results_is_rendered_and_answered(client, model, cluster):
    result = '{"city": "Paris", "temperature": 21, "sky": "sunny", "mark": "quokka-7731"}'
    messages = after_a_call(ASK, "call_abc", "get_weather", '{"city": "Paris", "unit": "celsius"}',
                            result)
    r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=24,
                                       temperature=0)
    answer = r.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls
    tokens, prompt = rendered(cluster.base_url, {"model": model, "messages": messages, "tools": TOOLS})
    assert len(tokens) == r.usage.prompt_tokens
    assert f"<tool_response>\n{result}\n</tool_response>" in prompt
    assert '"arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in prompt


def test_a_bad_parameters_schema_is_refused_naming_it(client, model):
    """When tool_choice runs the tools' grammar ("auto" compiles none)."""
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, tools=bad, max_tokens=4,
                                       tool_choice="required")
    assert e.value.body["param"] == "tools[0].function.parameters", e.value.body
