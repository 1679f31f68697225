"""beam_search at the edge: its fields checked, exclusive with sampling (each refused field named),
and the AddRequest the scheduler gets; the unary answer's completions; the HTTP fields."""
from __future__ import annotations

import pytest

from gateway.validation.beam_request import add_completion
from gateway.rest.openai_schema import CompletionRequest, completion_requests, openai_param
from gateway.tokenizer import load_tokenizer
from gateway.validation.validate import ValidationError, validate
from proto import internal_pb2 as ipb, pagoda_pb2 as pb
from tests.fake_scheduler import local_gateway, out
from tests.unit.gateway.test_gateway_validate import LIMITS, req, tok  # noqa: F401 - tok: a fixture

TOK = load_tokenizer("")


def beam(width=4, **kw) -> dict:
    return dict(prompt_token_ids=[1, 2, 3], beam_search=pb.BeamSearchParams(beam_width=width, **kw))


def test_defaults_are_filled_and_the_scheduler_gets_one_request(tok):
    v = validate(req(**beam(), stopping=dict(max_tokens=8)), tok, LIMITS, "gw-0", unary=True)
    assert v.n == 4 and v.add.n == 1
    assert (v.add.beam_search.beam_width, v.add.beam_search.length_penalty,
            v.add.beam_search.early_stopping) == (4, 1.0, "false")
    assert v.add.sampling.temperature == 0 and not v.add.sampling.HasField("logprobs")
    # Neutral sampling values may be spelled out.
    v = validate(req(**beam(2, length_penalty=0.5, early_stopping="never"),
                     sampling=dict(temperature=0, n=1, top_p=1.0)), tok, LIMITS, "gw-1")
    assert (v.add.beam_search.length_penalty, v.add.beam_search.early_stopping) == (0.5, "never")


@pytest.mark.parametrize("fields,field,fragment", [
    (dict(beam(0)), "beam_search.beam_width", "between 1 and 16, got 0"),
    (dict(beam(17)), "beam_search.beam_width", "between 1 and 16, got 17"),
    (dict(beam(early_stopping="sometimes")), "beam_search.early_stopping", "got 'sometimes'"),
    (dict(beam(length_penalty=float("nan"))), "beam_search.length_penalty", "finite"),
    (dict(beam(), sampling=dict(temperature=0.7)), "sampling.temperature", "cannot be used with beam_search"),
    (dict(beam(), sampling=dict(top_p=0.9)), "sampling.top_p", "cannot be used"),
    (dict(beam(), sampling=dict(top_k=5)), "sampling.top_k", "cannot be used"),
    (dict(beam(), sampling=dict(min_p=0.1)), "sampling.min_p", "cannot be used"),
    (dict(beam(), sampling=dict(presence_penalty=0.5)), "sampling.presence_penalty", "cannot be used"),
    (dict(beam(), sampling=dict(frequency_penalty=0.5)), "sampling.frequency_penalty", "cannot be used"),
    (dict(beam(), sampling=dict(repetition_penalty=1.2)), "sampling.repetition_penalty", "cannot be used"),
    (dict(beam(), sampling=dict(seed=7)), "sampling.seed", "cannot be used"),
    (dict(beam(), sampling=dict(n=2)), "sampling.n", "cannot be used"),
    (dict(beam(), sampling=dict(logprobs=1)), "sampling.logprobs", "cannot be used"),
    (dict(beam(), sampling=dict(logit_bias={5: 1.0})), "sampling.logit_bias", "cannot be used"),
    (dict(beam(), stopping=dict(stop=["x"])), "stopping.stop", "stop_token_ids can"),
    (dict(beam(), stopping=dict(min_tokens=2)), "stopping.min_tokens", "cannot be used"),
])
def test_bad_beam_requests_name_their_field(tok, fields, field, fragment):
    with pytest.raises(ValidationError) as e:
        validate(req(**fields), tok, LIMITS, "gw-0")
    assert e.value.field == field and str(e.value).startswith(field) and fragment in str(e.value)


def test_generate_lists_every_beam_with_the_best_on_top():
    out = pb.GenerateResponse()
    for index, ids in ((1, [7, 8]), (0, [5, 6, 2]), (2, [9])):  # in any order
        add_completion(out, pb.GenerateResponse(
            index=index, token_ids=ids, text=f"t{index}", cumulative_logprob=-float(index + 1),
            finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(prompt_tokens=3)))
    assert [c.index for c in out.completions] == [0, 1, 2]
    assert list(out.token_ids) == [5, 6, 2] and out.text == "t0" and out.cumulative_logprob == -1.0
    assert out.usage.completion_tokens == 6 and out.usage.prompt_tokens == 3


def test_http_fields_become_beam_search():
    body = CompletionRequest(model="m", prompt=[1, 2], n=3, use_beam_search=True,
                             length_penalty=0.5, early_stopping="never", max_tokens=4)
    [r] = completion_requests(body, 256)
    assert (r.beam_search.beam_width, r.beam_search.length_penalty,
            r.beam_search.early_stopping) == (3, 0.5, "never")
    assert not r.sampling.HasField("n")
    body = CompletionRequest(model="m", prompt="hi", n=2, use_beam_search=True, early_stopping=True)
    assert completion_requests(body, 256)[0].beam_search.early_stopping == "true"
    assert openai_param("beam_search.beam_width", chat=False) == "n"


BEAM_TEXTS = ["Paris is the capital.", "Paris, of course", "Lyon"]


def beam_plan(add: ipb.AddRequest) -> list:
    """What the scheduler sends at the end of a search: one delta per beam, whole, best first."""
    return [out(request_id=add.request_id, index=i,
                           token_ids=TOK.encode(text, add_special_tokens=False),
                           finish=ipb.LENGTH, prompt_tokens=len(add.prompt_token_ids),
                           cumulative_logprob=-1.5 * (i + 1))
            for i, text in enumerate(BEAM_TEXTS)]


def test_stream_and_generate_answer_with_every_beam(run):
    async def go():
        async with local_gateway(TOK) as h:
            h.scheduler.plan = beam_plan
            request = pb.GenerateRequest(**beam(3), stopping=pb.StoppingCriteria(max_tokens=8))
            streamed = [r async for r in h.stub.GenerateStream(request)]
            unary = await h.stub.Generate(request)
            return streamed, unary, list(h.scheduler.adds)
    streamed, unary, adds = run(go())
    assert adds[0].beam_search.beam_width == 3 and adds[0].n == 1
    # One final message per beam, best first, each with its whole text and its logprob sum.
    assert [(r.index, r.text, r.cumulative_logprob) for r in streamed] == \
        [(i, t, -1.5 * (i + 1)) for i, t in enumerate(BEAM_TEXTS)]
    assert all(r.finish_reason == pb.FINISH_REASON_LENGTH and not r.HasField("seed") for r in streamed)
    assert [(c.index, c.text) for c in unary.completions] == list(enumerate(BEAM_TEXTS))
    assert unary.text == BEAM_TEXTS[0] and unary.cumulative_logprob == -1.5
