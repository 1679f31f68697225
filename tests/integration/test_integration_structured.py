"""Structured outputs on the real stack with the real model: every constrained answer parses and
validates against its schema (jsonschema) or matches its regex / choice, through the real
`openai` client and gRPC, greedy and sampled, n > 1, streamed and whole; a grammar that allows
exactly what the model would pick changes nothing; bad specs get 400 naming the field."""
from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from proto import pagoda_pb2 as pb

pytestmark = pytest.mark.integration

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"type": "string", "maxLength": 20}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["items", "paid"],
         "properties": {"items": {"type": "array", "maxItems": 3, "items": {
             "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
             "properties": {"sku": {"enum": ["apple", "pear", "plum"]},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
             "paid": {"type": "boolean"},
             "note": {"type": "string", "maxLength": 12}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["temp_c", "sky"],
           "properties": {"temp_c": {"type": "number", "minimum": -50, "maximum": 60},
                          "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}}}
ASK = {PERSON["required"][0]: "Describe a fictional person as JSON.",
       "items": "Write a fruit order as JSON.", "temp_c": "Report the weather in Paris as JSON."}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_chat_answers_validate_greedy_sampled_and_n2(client, model):
    """Every schema greedy, and sampled with n = 2, all at once (one batch, each its own matcher)."""
    def ask(schema: dict, kw: dict):
        return schema, kw, client.chat.completions.create(
            model=model, max_tokens=160, response_format=schema_format(schema),
            messages=[{"role": "user", "content": ASK[next(iter(schema["required"]))]}], **kw)

    cases = [(schema, kw) for schema in (PERSON, ORDER, WEATHER)
             for kw in ({"temperature": 0}, {"temperature": 0.8, "seed": 11, "n": 2})]
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda case: ask(*case), cases))
    for schema, kw, r in answers:
        assert len(r.choices) == kw.get("n", 1)
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_a_streamed_answer_is_the_whole_one(client, model):
    kw = dict(model=model, max_tokens=160, temperature=0.7, seed=5, response_format=schema_format(ORDER),
              messages=[{"role": "user", "content": ASK["items"]}])
    with ThreadPoolExecutor(2) as pool:  # side by side: a seeded answer is the same in any batch
        whole = pool.submit(lambda: client.chat.completions.create(**kw).choices[0].message.content)
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(stream=True, **kw) if c.choices)
        whole = whole.result()
    assert streamed == whole
    jsonschema.validate(json.loads(whole), ORDER)


def test_vllm_structured_outputs_regex_choice_and_json_object_on_completions(client, model):
    regex = r"[A-Z][a-z]{2,8}, [A-Z]{2}"
    out = client.completions.create(model=model, prompt="A city and its country code:", max_tokens=20,
                                    temperature=0, extra_body={"structured_outputs": {"regex": regex}})
    assert out.choices[0].finish_reason == "stop" and re.fullmatch(regex, out.choices[0].text)
    choices = ["positive", "negative", "neutral"]
    for seed in range(3):
        out = client.completions.create(
            model=model, prompt="Review: 'I loved it.' Sentiment:", max_tokens=10, temperature=1.0,
            seed=seed, extra_body={"structured_outputs": {"choice": choices}})
        assert out.choices[0].text in choices
    out = client.chat.completions.create(
        model=model, max_tokens=60, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a JSON object with a key 'ok'."}])
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_a_grammar_allowing_only_the_models_own_answer_changes_no_token(stub):
    prompt = pb.GenerateRequest(prompt="The capital of France is",
                                sampling=pb.SamplingParams(temperature=0),
                                stopping=pb.StoppingCriteria(max_tokens=8, ignore_eos=True))
    free = stub.Generate(prompt, timeout=120)
    constrained = pb.GenerateRequest()
    constrained.CopyFrom(prompt)
    constrained.stopping.ignore_eos = False
    constrained.stopping.max_tokens = 9  # room for the EOS after the same 8 tokens
    constrained.sampling.structured_output.choice.values.append(free.text)
    responses = list(stub.GenerateStream(constrained, timeout=120))
    # The same 8 tokens, then complete: only EOS is left, which ends it (not max_tokens).
    assert [t for r in responses for t in r.token_ids] == list(free.token_ids) + [2]
    assert "".join(r.text for r in responses) == free.text
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "parenthesis"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs", "undefined_rule"),
    ({"structured_outputs": {"choice": ["a"]}, "use_beam_search": True, "n": 2}, "use_beam_search", "beam"),
])
def test_bad_specs_get_400_naming_the_field(client, model, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=4, extra_body=body)
    error = e.value.body
    assert error["param"] == param and words in error["message"], error


def test_grpc_structured_output_oneof_and_its_errors(stub):
    req = pb.GenerateRequest(prompt="Pick a number:", sampling=pb.SamplingParams(temperature=0),
                             stopping=pb.StoppingCriteria(max_tokens=12))
    req.sampling.structured_output.regex = "[0-9]{3}"
    answer = stub.Generate(req, timeout=120)
    assert re.fullmatch("[0-9]{3}", answer.text) and answer.finish_reason == pb.FINISH_REASON_STOP
    req.sampling.structured_output.regex = "[0-9"
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("sampling.structured_output.regex: ")


def test_a_schema_that_compiles_for_ever_costs_another_request_nothing(client, model):
    """A client's pattern that would compile for about 30 s (here) holds one compiler child until
    --max-grammar-compile-seconds refuses it; another client's schema is compiled in the other
    child meanwhile and answered, valid, before that refusal (with one child it waited for the
    limit and a restart: 5.8-7.7 s for an 8-token answer)."""
    def ask(schema, max_tokens=40):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": ASK["temp_c"]}], max_tokens=max_tokens,
            temperature=0, response_format=schema_format(schema))

    with ThreadPoolExecutor(3) as pool:
        # Both children started (a lazy cluster starts them on the structured requests that need them).
        list(pool.map(ask, [WEATHER, {**WEATHER, "required": ["sky", "temp_c"]}]))
        bomb = pool.submit(ask, {"type": "string", "pattern": "^(\\w+\\s?)*{41}$"}, 4)
        time.sleep(1.0)  # the bomb reaches a child first
        answer = pool.submit(ask, {**WEATHER, "required": ["temp_c"]}).result(timeout=60)
        refused_after = not bomb.done()
        with pytest.raises(openai.BadRequestError) as refused:
            bomb.result(timeout=60)
    jsonschema.validate(json.loads(answer.choices[0].message.content), {**WEATHER, "required": ["temp_c"]})
    assert refused_after
    assert refused.value.body["param"] == "response_format"
    assert "took longer than 5 s (--max-grammar-compile-seconds)" in refused.value.body["message"]
