"""Decoding helpers for messages whose layout is columnar for speed (see internal.proto)."""
from __future__ import annotations

from proto import internal_pb2 as pb
from proto.columns import unpack_list


def expand_deltas(msg: pb.SchedulerMessage) -> list[pb.TokenDelta]:
    """A SchedulerMessage as one TokenDelta per entry, in the order a receiver applies them:
    the token columns first, then the deltas that carry usage, finishes and errors."""
    indices, num_tokens, token_ids, offsets = (unpack_list(c) for c in (
        msg.indices, msg.num_tokens, msg.token_ids, msg.offsets))
    if not len(msg.request_ids) == len(indices) == len(num_tokens) == len(offsets) \
            or sum(num_tokens) != len(token_ids):
        raise ValueError("a SchedulerMessage's token columns do not line up")
    out, pos = [], 0
    for rid, index, n, offset in zip(msg.request_ids, indices, num_tokens, offsets):
        out.append(pb.TokenDelta(request_id=rid, index=index, token_ids=token_ids[pos:pos + n],
                                 offset=offset))
        pos += n
    out.extend(msg.deltas)
    return out
