"""How many sequences a request may ask for, each bound defined once: the public n (gateway
MAX_N) and beam width (proto/sizes.py MAX_BEAM_WIDTH, checked at the gateway and again by the
scheduler) both fit what the internal link carries (MAX_REQUEST_SEQUENCES), so nothing the
gateway lets through is refused inside."""
from __future__ import annotations

from gateway.validation.beam_request import beam_params
from gateway.validation.limits import MAX_N
from proto import internal_pb2, pagoda_pb2
from proto.sizes import MAX_BEAM_WIDTH, MAX_REQUEST_SEQUENCES
from scheduler.message_checks import check_abort, check_add


def test_the_public_bounds_fit_the_internal_one():
    assert 1 <= MAX_N <= MAX_REQUEST_SEQUENCES
    assert 1 <= MAX_BEAM_WIDTH <= MAX_REQUEST_SEQUENCES


def test_the_scheduler_takes_the_widest_request_the_gateway_passes():
    search = beam_params(pagoda_pb2.GenerateRequest(
        beam_search=pagoda_pb2.BeamSearchParams(beam_width=MAX_BEAM_WIDTH)))
    beam = internal_pb2.AddRequest(prompt_token_ids=[1], n=1, max_tokens=1, beam_search=search)
    sampled = internal_pb2.AddRequest(prompt_token_ids=[1], n=MAX_N, max_tokens=1)
    assert check_add(beam, vocab_size=8) is None and check_add(sampled, vocab_size=8) is None
    every_index = internal_pb2.AbortRequest(request_id="r", indices=range(MAX_N))
    assert check_abort(every_index) is None
    wider = pagoda_pb2.BeamSearchParams(beam_width=MAX_BEAM_WIDTH + 1)
    assert check_add(internal_pb2.AddRequest(prompt_token_ids=[1], n=1, max_tokens=1,
                                             beam_search=wider), vocab_size=8) is not None
