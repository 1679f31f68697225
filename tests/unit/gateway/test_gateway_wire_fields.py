"""largest_field names the field of an unparsed message that holds most of its bytes, reading at
most MOST_FIELDS fields, and survives truncated and invalid bytes."""
from __future__ import annotations

from gateway.bounds.wire_fields import MOST_FIELDS, largest_field
from proto import pagoda_pb2 as pb

GENERATE = pb.GenerateRequest.DESCRIPTOR


def test_the_field_with_most_bytes_is_named_whatever_its_place():
    req = pb.GenerateRequest(request_id="x" * 100, prompt="y" * 1000,
                             stopping=pb.StoppingCriteria(max_tokens=5, stop=["z" * 50]))
    assert largest_field(req.SerializeToString(), GENERATE) == "prompt"
    ids = pb.GenerateRequest(prompt_token_ids=list(range(10_000)), request_id="x" * 100)
    assert largest_field(ids.SerializeToString(), GENERATE) == "prompt_token_ids"
    chat = pb.GenerateRequest(messages=[pb.ChatMessage(content="a" * 300)] * 10, prompt="b" * 1000)
    assert largest_field(chat.SerializeToString(), GENERATE) == "messages"  # 10 x 300 > 1000


def test_truncated_invalid_and_unknown_bytes_name_what_was_read_or_the_request():
    raw = pb.GenerateRequest(prompt="y" * 1000).SerializeToString()
    assert largest_field(raw[:500], GENERATE) == "prompt"
    assert largest_field(b"\xff" * 20, GENERATE) == "request"
    assert largest_field(b"", GENERATE) == "request"
    unknown = b"".join(bytes([(900 << 3 | 2) & 0x7F | 0x80, 900 >> 4, 3]) + b"abc" for _ in range(5))
    assert largest_field(unknown, GENERATE) == "request"


def test_only_the_first_fields_are_read():
    one = pb.GenerateRequest(request_id="r").SerializeToString()  # 3 bytes
    raw = one * (MOST_FIELDS + 1000) + pb.GenerateRequest(prompt="y" * 100_000).SerializeToString()
    assert largest_field(raw, GENERATE) == "request_id"
