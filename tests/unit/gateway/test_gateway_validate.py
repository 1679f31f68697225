"""GenerateRequest validation: every bad input names its field; good inputs become AddRequests."""
from __future__ import annotations

import argparse
import json
import math

import pytest

from gateway.gateway_flags import REQUEST_LIMITS, parse_gateway_args
from gateway.tokenizer import load_tokenizer
from gateway.validation.limits import Limits, limits_from_args
from gateway.validation.validate import ValidationError, prompt_ids, prompt_offsets, validate
from proto import internal_pb2, pagoda_pb2 as pb
from tests.bad_requests import BAD_REQUESTS, MAX_MODEL_LEN, build, case_id, spec
from tests.unit.gateway.test_gateway_tokenizer import tiny_bos_tokenizer

MAX_LEN = 64
VOCAB = 49152
LIMITS = Limits(max_model_len=MAX_LEN, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("")


def req(**kw) -> pb.GenerateRequest:
    sampling = kw.pop("sampling", {})
    stopping = kw.pop("stopping", {})
    if "messages" in kw:
        kw["messages"] = [pb.ChatMessage(role=r, content=c) for r, c in kw["messages"]]
    return pb.GenerateRequest(sampling=pb.SamplingParams(**sampling),
                              stopping=pb.StoppingCriteria(**stopping), **kw)


def check(tok, request, unary=False) -> internal_pb2.AddRequest:
    return validate(request, tok, LIMITS, "gw-0", unary=unary).add


BAD = [
    # (request, field named in the message, a fragment of the message)
    (dict(), "prompt", "exactly one of prompt, prompt_token_ids and messages"),
    (dict(prompt=""), "prompt", "got none"),
    (dict(messages=[]), "prompt", "and messages must be set, got none"),  # proto3: [] is unset
    (dict(prompt="hi", prompt_token_ids=[1, 2]), "prompt_token_ids", "got prompt and prompt_token_ids"),
    (dict(prompt="hi", messages=[("user", "x")]), "messages", "got prompt and messages"),
    (dict(prompt_token_ids=[1, 2], messages=[("user", "x")]), "messages", "prompt_token_ids and messages"),
    (dict(prompt="word " * 200), "prompt", "max_model_len 64"),
    (dict(prompt_token_ids=[5] * MAX_LEN), "prompt_token_ids", "is 64 tokens"),
    (dict(messages=[("user", "word " * 100)]), "messages", "max_model_len"),
    (dict(prompt_token_ids=[1, VOCAB]), "prompt_token_ids[1]", "= 49152 is out of range"),
    (dict(prompt_token_ids=[2**32 - 1]), "prompt_token_ids[0]", "out of range"),
    (dict(prompt="hi", stopping=dict(max_tokens=-5)), "stopping.max_tokens",
     "stopping.max_tokens must be >= 1, got -5"),
    (dict(prompt="hi", stopping=dict(max_tokens=0)), "stopping.max_tokens", ">= 1, got 0"),
    (dict(prompt_token_ids=[5] * 10, stopping=dict(max_tokens=55)), "stopping.max_tokens",
     "10 tokens) + max_tokens (55) = 65 exceeds max_model_len 64"),
    (dict(prompt="hi", sampling=dict(temperature=math.nan)), "sampling.temperature", "got nan"),
    (dict(prompt="hi", sampling=dict(temperature=math.inf)), "sampling.temperature", "got inf"),
    (dict(prompt="hi", sampling=dict(temperature=-0.5)), "sampling.temperature", "[0, 1e+06], got -0.5"),
    (dict(prompt="hi", sampling=dict(top_p=0.0)), "sampling.top_p", "(0, 1], got 0"),
    (dict(prompt="hi", sampling=dict(top_p=1.5)), "sampling.top_p", "got 1.5"),
    (dict(prompt="hi", sampling=dict(top_p=math.nan)), "sampling.top_p", "got nan"),
    (dict(prompt="hi", sampling=dict(top_p=-1)), "sampling.top_p", "got -1"),
    (dict(prompt="hi", sampling=dict(top_k=-1)), "sampling.top_k", "[0, 1048576] (0 = off), got -1"),
    (dict(prompt="hi", sampling=dict(n=0)), "sampling.n", "between 1 and 16, got 0"),
    (dict(prompt="hi", sampling=dict(n=17)), "sampling.n", "got 17"),
    (dict(messages=[("user", "hi"), ("bot", "x")]), "messages[1].role",
     "messages[1].role must be one of system, user, assistant, tool, got 'bot'"),
    (dict(messages=[("", "hi")]), "messages[0].role", "got ''"),
    (dict(prompt="hi", stopping=dict(stop_token_ids=[2, 50000])), "stopping.stop_token_ids[1]",
     "= 50000 is out of range: vocab_size is 49152"),
    (dict(prompt="hi", stopping=dict(stop=["ok", ""])), "stopping.stop[1]", "must not be empty"),
]


@pytest.mark.parametrize("kw,field,fragment", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_input_names_the_field(tok, kw, field, fragment):
    with pytest.raises(ValidationError) as e:
        check(tok, req(**kw))
    assert e.value.field == field
    assert field.split("[")[0] in str(e.value)
    assert fragment in str(e.value)


def test_unary_rejects_n_above_one(tok):
    with pytest.raises(ValidationError) as e:
        check(tok, req(prompt="hi", sampling=dict(n=2)), unary=True)
    assert e.value.field == "sampling.n" and "GenerateStream" in str(e.value)
    assert check(tok, req(prompt="hi", sampling=dict(n=2))).n == 2


def test_defaults(tok):
    add = check(tok, req(prompt="Hello world"))
    assert list(add.prompt_token_ids) == tok.encode("Hello world")
    assert add.request_id == "gw-0"
    assert (add.sampling.temperature, add.sampling.top_p, add.sampling.top_k) == (1.0, 1.0, 0)
    assert add.sampling.has_seed  # drawn: see test_seed_is_drawn_when_unset
    assert add.n == 1
    # min(256, max_model_len - prompt_len)
    assert add.max_tokens == MAX_LEN - len(add.prompt_token_ids)
    assert list(add.stop_token_ids) == [] and not add.ignore_eos  # EOS is the scheduler's job
    big = validate(req(prompt="Hello world"), tok, Limits(4096, VOCAB), "x").add
    assert big.max_tokens == 256


def test_good_inputs_pass_through(tok):
    add = check(tok, req(prompt_token_ids=[1, 2, 3], priority=-3,
                         sampling=dict(temperature=0.0, top_p=1.0, top_k=40, seed=7, n=16),
                         stopping=dict(max_tokens=61, ignore_eos=True, stop_token_ids=[5, 6])))
    assert list(add.prompt_token_ids) == [1, 2, 3]
    assert add.sampling.temperature == 0.0 and add.sampling.top_k == 40
    assert add.sampling.has_seed and add.sampling.seed == 7
    assert add.n == 16 and add.max_tokens == 61 and add.priority == -3
    assert add.ignore_eos and list(add.stop_token_ids) == [5, 6]
    # A prompt of max_model_len - 1 tokens leaves room for exactly one output token.
    assert check(tok, req(prompt_token_ids=[5] * (MAX_LEN - 1))).max_tokens == 1
    assert check(tok, req(prompt="x", sampling=dict(top_p=1e-6))).sampling.top_p > 0


def test_messages_use_the_chat_template(tok):
    msgs = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"), ("tool", "{}"), ("user", "Bye")]
    add = check(tok, req(messages=msgs))
    text = tok.decode(add.prompt_token_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")


# ---------------------------------------------------------------------------- the shared bad list

SMOL_LIMITS = Limits(max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB)


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[case_id(i, c) for i, c in enumerate(BAD_REQUESTS)])
def test_bad_requests_name_their_field(tok, case):
    with pytest.raises(ValidationError) as e:
        validate(build(case), tok, SMOL_LIMITS, "gw-0")
    message, name = str(e.value), case[1]
    assert name in message
    assert message.startswith(e.value.field) and e.value.field.startswith(name)


def test_bad_requests_are_many_distinct_and_json():
    assert len(BAD_REQUESTS) >= 40
    specs = [json.dumps(spec(c), sort_keys=True) for c in BAD_REQUESTS]  # grpcurl -d takes these
    assert len(set(specs)) == len(specs)
    assert len({build(c).SerializeToString(deterministic=True) for c in BAD_REQUESTS}) == len(specs)


class _NoTokenizing:
    """A tokenizer that fails the test if asked to encode anything."""
    vocab_size = VOCAB

    def encode(self, text, add_special_tokens=True):
        raise AssertionError(f"tokenized {len(text)} characters")

    render_chat = encode


@pytest.mark.parametrize("kw,name,says", [
    (dict(prompt="word " * 2_000_000), "prompt", "max_model_len"),
    (dict(messages=[pb.ChatMessage(role="user", content="x" * 200_000)] * 2), "messages",
     "max_model_len"),
    (dict(messages=[pb.ChatMessage(role="user", content="x")] * 257), "messages", "at most 256"),
])
def test_huge_prompts_are_refused_before_tokenizing(kw, name, says):
    with pytest.raises(ValidationError) as e:
        validate(pb.GenerateRequest(**kw), _NoTokenizing(), SMOL_LIMITS, "gw-0")
    assert e.value.field == name
    assert says in str(e.value)


# ---------------------------------------------------------------------------- good paths


def test_new_fields_land_in_the_add_request(tok):
    v = validate(req(prompt_token_ids=[1, 2, 3], request_id="client-7", truncate_prompt_tokens=8,
                     skip_special_tokens=False, return_prompt_token_ids=True,
                     sampling=dict(min_p=0.05, presence_penalty=-2.0, frequency_penalty=2.0,
                                   repetition_penalty=1.25, logit_bias={7: -100.0, VOCAB - 1: 100.0},
                                   logprobs=5, prompt_logprobs=0, seed=11),
                     stopping=dict(max_tokens=20, min_tokens=4, include_stop_str_in_output=True,
                                   stop=["\n"])),
                 tok, LIMITS, "gw-0")
    s = v.add.sampling
    assert s.min_p == pytest.approx(0.05) and (s.presence_penalty, s.frequency_penalty) == (-2.0, 2.0)
    assert s.repetition_penalty == 1.25 and dict(s.logit_bias) == {7: -100.0, VOCAB - 1: 100.0}
    assert s.HasField("logprobs") and s.logprobs == 5
    assert s.HasField("prompt_logprobs") and s.prompt_logprobs == 0  # 0 is set, not absent
    assert s.min_tokens == 4 and list(s.stop_token_ids) == []  # the scheduler fills stop_token_ids
    assert (s.has_seed, s.seed) == (True, 11)
    assert (v.add.public_id, v.add.request_id) == ("client-7", "gw-0")
    assert (v.logprobs, v.prompt_logprobs, v.seed, v.min_tokens) == (5, 0, 11, 4)
    assert v.include_stop_str_in_output and v.return_prompt_token_ids and not v.skip_special_tokens
    assert v.public_id == "client-7" and v.stop == ["\n"]


def test_neutral_defaults(tok):
    v = validate(req(prompt="Hi"), tok, LIMITS, "gw-0")
    s = v.add.sampling
    assert (s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0, 0, 0, 1.0)
    assert not s.HasField("logprobs") and not s.HasField("prompt_logprobs") and not s.logit_bias
    assert (v.logprobs, v.prompt_logprobs, v.min_tokens, s.min_tokens) == (None, None, 0, 0)
    assert v.skip_special_tokens and not v.include_stop_str_in_output and not v.return_prompt_token_ids
    assert v.public_id == v.add.public_id == "gw-0"  # no client id: the internal one


def test_bounds_are_inclusive(tok):
    ok = req(prompt="Hi", request_id="r" * 256, priority=-1_000_000,
             sampling=dict(min_p=1.0, presence_penalty=2.0, frequency_penalty=-2.0,
                           repetition_penalty=1e-3, logprobs=20, prompt_logprobs=20,
                           logit_bias={i: 100.0 for i in range(1024)}),
             stopping=dict(max_tokens=8, min_tokens=8, stop=["x" * 256] + ["y"] * 15,
                           stop_token_ids=list(range(64))))
    v = validate(ok, tok, LIMITS, "gw-0")
    assert (v.logprobs, v.min_tokens, len(v.add.sampling.logit_bias)) == (20, 8, 1024)
    many = [pb.ChatMessage(role="user", content="x")] * 256
    assert validate(pb.GenerateRequest(messages=many), tok, SMOL_LIMITS, "gw-0").prompt_token_ids


def test_seed_is_drawn_when_unset_and_kept_when_set(tok):
    drawn = [validate(req(prompt="Hi"), tok, LIMITS, "gw-0") for _ in range(4)]
    assert all(v.add.sampling.has_seed and v.seed == v.add.sampling.seed for v in drawn)
    assert all(0 <= v.seed < 2**63 for v in drawn)
    assert len({v.seed for v in drawn}) == 4  # 63 random bits: a repeat would be a bug
    for seed in (0, 7, 2**64 - 1):
        v = validate(req(prompt="Hi", sampling=dict(seed=seed)), tok, LIMITS, "gw-0")
        assert (v.seed, v.add.sampling.seed, v.add.sampling.has_seed) == (seed, seed, True)


def test_truncation_keeps_the_last_k(tok):
    v = validate(req(prompt_token_ids=list(range(1, 11)), truncate_prompt_tokens=3), tok, LIMITS, "x")
    assert v.prompt_token_ids == list(v.add.prompt_token_ids) == [8, 9, 10]
    text = "one two three four five six seven"
    v = validate(req(prompt=text, truncate_prompt_tokens=2), tok, LIMITS, "x")
    assert v.prompt_token_ids == tok.encode(text)[-2:]
    assert validate(req(prompt_token_ids=[4, 5], truncate_prompt_tokens=9), tok, LIMITS,
                    "x").prompt_token_ids == [4, 5]
    # Truncation comes before the max_model_len check: a prompt too long on its own passes.
    v = validate(req(prompt_token_ids=[5] * (MAX_LEN * 3), truncate_prompt_tokens=10), tok, LIMITS, "x")
    assert len(v.prompt_token_ids) == 10 and v.add.max_tokens == MAX_LEN - 10


def test_min_tokens_and_the_default_max_tokens(tok):
    big = Limits(4096, VOCAB)
    assert validate(req(prompt="Hi", stopping=dict(min_tokens=300)), tok, big, "x").add.max_tokens == 300
    with pytest.raises(ValidationError, match=r"^stopping.min_tokens \(70\) must be <= max_tokens"):
        validate(req(prompt="Hi", stopping=dict(min_tokens=70)), tok, LIMITS, "x")


def test_limits_follow_the_flags(tok):
    defaults = Limits(max_model_len=1, vocab_size=2)
    assert {d: getattr(defaults, d) for d, *_ in REQUEST_LIMITS} == {d: v for d, v, *_ in REQUEST_LIMITS}
    assert limits_from_args(parse_gateway_args([]), 1, 2) == defaults
    assert limits_from_args(argparse.Namespace(), 1, 2) == defaults  # flags absent: defaults
    limits = limits_from_args(parse_gateway_args(["--max-logprobs", "5", "--max-priority", "3"]),
                              MAX_LEN, VOCAB)
    assert (limits.max_logprobs, limits.max_priority, limits.max_model_len) == (5, 3, MAX_LEN)
    with pytest.raises(ValidationError, match=r"^sampling.logprobs must be in \[0, 5\], got 6"):
        validate(req(prompt="Hi", sampling=dict(logprobs=6)), tok, limits, "x")
    with pytest.raises(ValidationError, match=r"^priority must be in \[-3, 3\], got 4"):
        validate(req(prompt="Hi", priority=4), tok, limits, "x")


def test_tokenize_add_special_tokens():
    tiny = tiny_bos_tokenizer()
    ask = pb.TokenizeRequest
    assert prompt_ids(ask(prompt="hello world"), tiny, 5) == ("prompt", [0, 2, 3])
    assert prompt_ids(ask(prompt="hello world", add_special_tokens=False), tiny, 5)[1] == [2, 3]
    assert prompt_ids(ask(prompt="hello world"), tiny, 5, add_special_tokens=False)[1] == [2, 3]
    assert prompt_offsets(ask(prompt="hello world"), tiny) == \
        ("hello world", [0, 2, 3], [(0, 0), (0, 5), (6, 11)])


def test_tokenize_messages_offsets_index_the_rendered_chat(tok):
    request = pb.TokenizeRequest(messages=[pb.ChatMessage(role="user", content="naïve 😀")])
    text, ids, offsets = prompt_offsets(request, tok)
    assert text == tok.render_chat([{"role": "user", "content": "naïve 😀"}])
    assert ids == prompt_ids(request, tok, VOCAB)[1] == tok.encode(text, add_special_tokens=False)
    assert text[offsets[0][0]:offsets[0][1]] == "<|im_start|>" and offsets[-1][1] == len(text)
