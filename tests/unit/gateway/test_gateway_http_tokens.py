"""The /tokenize answer written in pieces is the JSON of the whole answer, whatever its size."""
from __future__ import annotations

import json

import pytest

from gateway.rest.http_tokens import tokenize_json
from proto import pagoda_pb2


@pytest.mark.parametrize("count", [0, 1, 8191, 8192, 8193, 100_000])
@pytest.mark.parametrize("max_model_len", [None, 8192])
def test_a_tokenize_answer_in_pieces_is_the_whole_answers_json(count, max_model_len):
    reply = pagoda_pb2.TokenizeResponse(token_ids=[(i * 7919) % 49152 for i in range(count)])
    body = tokenize_json(reply.token_ids, max_model_len)
    assert json.loads(body) == {"count": count, "tokens": list(reply.token_ids),
                                "max_model_len": max_model_len}
