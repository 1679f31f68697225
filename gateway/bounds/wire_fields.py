"""Which top-level field of an unparsed protobuf message holds most of its bytes, read from the
wire format's tags and lengths alone: a request refused for its size before parsing is still
refused naming the field at fault."""
from __future__ import annotations

from collections import Counter

from google.protobuf.descriptor import Descriptor

# Fields read at most: past them the walk would cost in proportion to what the client sent.
MOST_FIELDS = 64


def _varint(raw: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80 or shift > 63:
            return value, at
        shift += 7


def largest_field(raw: bytes, descriptor: Descriptor) -> str:
    """The name of the field whose encodings take most of `raw`'s first MOST_FIELDS fields;
    "request" when none of them is one of the descriptor's."""
    sizes: Counter[int] = Counter()
    at = 0
    try:
        for _ in range(MOST_FIELDS):
            if at >= len(raw):
                break
            key, start = _varint(raw, at)
            wire = key & 7
            if wire == 0:
                _, at = _varint(raw, start)
            elif wire == 1:
                at = start + 8
            elif wire == 2:
                length, at = _varint(raw, start)
                at += length
            elif wire == 5:
                at = start + 4
            else:  # groups (3, 4) and invalid types: nothing further can be read
                break
            sizes[key >> 3] += min(at, len(raw)) - start
    except IndexError:  # a truncated field: what was read counts
        pass
    for number, _ in sizes.most_common():
        field = descriptor.fields_by_number.get(number)
        if field is not None:
            return field.name
    return "request"
