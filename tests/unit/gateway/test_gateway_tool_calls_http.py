"""Function calling through the real `openai` client against the real gateway and scheduler
processes around a fake worker that answers canned text (tests/fake_worker_canned.py), since
SmolLM2 will not choose a function by itself: tool_choice "auto" parsed whole and streamed (the
SDK's own stream accumulator reassembles the deltas), n > 1 read per choice, plain text left as
content, parallel_tool_calls, tool_choice "none", a conversation with calls and results sent
back, and the 400s that name the field."""
from __future__ import annotations

import json

import openai
from openai.lib.streaming.chat import ChatCompletionStreamState
import pytest

from gateway.tokenizer import load_tokenizer
from tests.fake_cluster import FakeCluster
from tests.fake_worker_canned import byte_tokens
from tests.tool_calls import after_a_call, rendered

TOK = load_tokenizer("")
MODEL = TOK.name
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
# Seed -> what the fake model says (index i of n > 1 is seeded seed + i).
CANNED = {
    11: "Let me check.\n" + CALL,
    12: "It is sunny in Paris.",
    13: CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
    14: "<tool_call>{not json}</tool_call> sorry",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    canned = folder / "canned.json"
    canned.write_text(json.dumps({str(k): byte_tokens(TOK, v) for k, v in CANNED.items()}))
    c = FakeCluster(folder, http=True, worker_module="tests.fake_worker_canned",
                    worker_flags=["--canned", str(canned), "--vocab-size", str(TOK.vocab_size),
                                  "--num-gpu-blocks-override", "4096"]).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)


def ask(client, seed: int, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), seed=seed,
                                          max_tokens=300, tools=kw.pop("tools", [WEATHER, TIME]), **kw)


def calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_auto_calls_are_parsed_and_plain_text_stays_content(client):
    r = ask(client, 11, n=2)
    first, second = r.choices
    assert calls(first.message) == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert first.message.content == "Let me check." and first.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert (second.message.content, second.message.tool_calls, second.finish_reason) == (
        "It is sunny in Paris.", None, "stop")
    broken = ask(client, 14).choices[0]
    assert (broken.message.content, broken.message.tool_calls, broken.finish_reason) == (
        CANNED[14], None, "stop")


def test_streamed_calls_reassemble_in_the_sdk_into_the_whole_answer(client):
    whole = ask(client, 11, n=2)
    chunks = list(ask(client, 11, n=2, stream=True))
    # OpenAI's shape: a call's first delta has its id, type and name, arguments "" ...
    deltas = [d for ch in chunks for c in ch.choices for d in c.delta.tool_calls or []]
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert deltas[0].function.arguments == "" and deltas[1].id is None
    # ... then its arguments as the model writes them, in pieces.
    assert len([d for d in deltas[1:] if d.function.arguments]) > 3
    state = ChatCompletionStreamState()
    for ch in chunks:
        state.handle_chunk(ch)
    streamed = state.get_final_completion()
    assert [(c.index, c.finish_reason, c.message.content, calls(c.message)) for c in streamed.choices] \
        == [(c.index, c.finish_reason, c.message.content, calls(c.message)) for c in whole.choices]
    with client.chat.completions.stream(model=MODEL, messages=ASK, seed=13, max_tokens=300,
                                        tools=[WEATHER, TIME]) as s:
        final = s.get_final_completion().choices[0]
    assert [name for name, _ in calls(final.message)] == ["get_weather", "get_time"]
    assert final.finish_reason == "tool_calls" and not final.message.content


def test_parallel_tool_calls_false_keeps_the_first_and_none_parses_nothing(client):
    for stream in (False, True):
        kw = dict(parallel_tool_calls=False)
        if stream:
            state = ChatCompletionStreamState()
            for ch in ask(client, 13, stream=True, **kw):
                state.handle_chunk(ch)
            choice = state.get_final_completion().choices[0]
        else:
            choice = ask(client, 13, **kw).choices[0]
        assert calls(choice.message) == [("get_weather", {"city": "Paris", "unit": "c"})]
    plain = ask(client, 11, tool_choice="none").choices[0]
    assert (plain.message.content, plain.message.tool_calls, plain.finish_reason) == (
        CANNED[11], None, "stop")


def test_a_conversation_with_calls_and_results_renders_them(client, stack):
    result = "21 degrees <|im_end|> and sunny"
    messages = after_a_call(ASK, "call_1", "get_weather", '{"city": "Paris", "unit": "c"}', result)
    r = ask(client, 12, messages=messages)
    assert r.choices[0].message.content == CANNED[12]
    tokens, text = rendered(stack.base_url, {"model": MODEL, "messages": messages,
                                             "tools": [WEATHER, TIME]})
    assert len(tokens) == r.usage.prompt_tokens  # what the chat rendered
    assert f"<tool_response>\n{result}\n</tool_response>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in text
    assert json.dumps(WEATHER) in text  # the tools, in the system turn
    # The result's special-token text stayed text: only the template's turns are tokens.
    assert tokens.count(TOK.tokenizer.token_to_id("<|im_end|>")) == 4


@pytest.mark.parametrize("kw, param, words", [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name", "twice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name",
     "letters"),
    # Compiled only when tool_choice runs its grammar ("auto" compiles nothing).
    (dict(tool_choice="required", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objectx"}}}]), "tools[0].function.parameters", "objectx"),
    (dict(tool_choice={"type": "function", "function": {"name": "g"}}, tools=[TIME, {
        "type": "function", "function": {"name": "g", "parameters": {"type": "objectx"}}}]),
     "tools[1].function.parameters", "objectx"),
    (dict(tools=None, tool_choice="auto"), "tool_choice", "only allowed"),
    (dict(tool_choice="required", response_format={"type": "json_object"}), "tool_choice", "grammar"),
    (dict(messages=ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "{oops"}}]}]),
     "messages[1].tool_calls[0].function.arguments", "JSON"),
])
def test_bad_tool_requests_get_400_naming_the_field(client, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, 12, **{k: v for k, v in kw.items() if v is not None},
            **({"tools": openai.NOT_GIVEN} if "tools" in kw and kw["tools"] is None else {}))
    error = e.value.body
    assert error["param"] == param and words in error["message"], error
