"""GenerateRequest validation: every bad input names its field; good inputs become AddRequests."""
from __future__ import annotations

import math

import pytest

from gateway.tokenizer import load_tokenizer
from gateway.validate import Limits, ValidationError, validate
from proto import internal_pb2, pagoda_pb2 as pb

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
    (dict(prompt="hi", sampling=dict(temperature=-0.5)), "sampling.temperature", ">= 0, got -0.5"),
    (dict(prompt="hi", sampling=dict(top_p=0.0)), "sampling.top_p", "(0, 1], got 0"),
    (dict(prompt="hi", sampling=dict(top_p=1.5)), "sampling.top_p", "got 1.5"),
    (dict(prompt="hi", sampling=dict(top_p=math.nan)), "sampling.top_p", "got nan"),
    (dict(prompt="hi", sampling=dict(top_p=-1)), "sampling.top_p", "got -1"),
    (dict(prompt="hi", sampling=dict(top_k=-1)), "sampling.top_k", ">= 0 (0 = off), got -1"),
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
    assert not add.sampling.has_seed
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
