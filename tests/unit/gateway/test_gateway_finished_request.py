"""validate returns the AddRequest the scheduler gets, finished: the caller's tenant, its cache
salt, its priority range and final_only are decided there, before tokenizing, and nothing is
patched in afterwards."""
from __future__ import annotations

import pytest

from gateway.bounds.client_auth import tenant_of_key
from gateway.validation.limits import Limits
from gateway.tokenizer import load_tokenizer
from gateway.validation.validate import Caller, ValidationError, validate
from proto import pagoda_pb2 as pb

LIMITS = Limits(max_model_len=64, vocab_size=49152)
TENANT = tenant_of_key("key-a")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("")


class _NoTokenizing:
    """A tokenizer that fails the test if asked to encode anything."""
    vocab_size = 49152

    def encode(self, text, add_special_tokens=True):
        raise AssertionError(f"tokenized {len(text)} characters")

    def encode_bounded(self, text, *args):
        raise AssertionError(f"tokenized {len(text)} characters")


def test_the_tenant_namespaces_the_public_id_and_salts_the_cache(tok):
    request = pb.GenerateRequest(prompt="Hi", request_id="client-7", cache_salt="s1")
    v = validate(request, tok, LIMITS, "gw-0", caller=Caller(tenant=TENANT))
    assert (v.add.tenant, v.add.public_id, v.add.cache_salt) == (TENANT, TENANT + "client-7",
                                                                 TENANT + "s1")
    assert (v.add.request_id, v.public_id) == ("gw-0", "client-7")  # the client sees its own id
    shared = validate(request, tok, LIMITS, "gw-0",
                      caller=Caller(tenant=TENANT, salt_by_tenant=False))
    assert (shared.add.tenant, shared.add.cache_salt) == (TENANT, "s1")  # --shared-prefix-cache


def test_without_keys_the_request_is_its_own():
    v = validate(pb.GenerateRequest(prompt_token_ids=[1, 2], cache_salt="s1"), _NoTokenizing(),
                 LIMITS, "gw-0")
    assert (v.add.tenant, v.add.public_id, v.add.cache_salt) == ("", "gw-0", "s1")


@pytest.mark.parametrize("priority,ok", [(0, True), (5, True), (-1, False), (6, False)])
def test_the_tenants_priority_range_is_checked_before_tokenizing(priority, ok):
    request = pb.GenerateRequest(prompt="x" * 100, priority=priority)  # tokenizing would fail
    caller = Caller(tenant=TENANT, priorities=(0, 5))
    if ok:
        with pytest.raises(AssertionError, match="tokenized"):
            validate(request, _NoTokenizing(), LIMITS, "gw-0", caller=caller)
        return
    with pytest.raises(ValidationError) as e:
        validate(request, _NoTokenizing(), LIMITS, "gw-0", caller=caller)
    assert e.value.field == "priority"
    assert str(e.value) == f"priority must be in [0, 5] for this API key, got {priority}"


def test_the_flags_priority_bound_is_named_first():
    """Past --max-priority the message names the flag's bound, as without keys."""
    with pytest.raises(ValidationError, match=r"priority must be in \[-1000000, 1000000\]"):
        validate(pb.GenerateRequest(prompt="x", priority=2_000_000), _NoTokenizing(), LIMITS,
                 "gw-0", caller=Caller(tenant=TENANT, priorities=(0, 5)))


@pytest.mark.parametrize("whole,kw,final_only", [
    (True, {}, True),
    (False, {}, False),  # streamed: read step by step
    (True, dict(stopping=pb.StoppingCriteria(stop=["\n"])), False),  # the gateway ends it
    (True, dict(sampling=pb.SamplingParams(logprobs=1)), False),  # extras in messages of their own
    (True, dict(sampling=pb.SamplingParams(prompt_logprobs=0)), False),
    (True, dict(beam_search=pb.BeamSearchParams(beam_width=2)), False),  # whole anyway
])
def test_final_only_is_decided_by_validation(tok, whole, kw, final_only):
    v = validate(pb.GenerateRequest(prompt="Hi", **kw), tok, LIMITS, "gw-0",
                 caller=Caller(whole=whole))
    assert v.add.final_only is final_only
