"""Decoding helpers for messages whose layout is columnar for speed (see internal.proto)."""
from __future__ import annotations

from proto import internal_pb2 as pb


def expand_deltas(msg: pb.SchedulerMessage) -> list[pb.TokenDelta]:
    """A SchedulerMessage as one TokenDelta per entry, in the order a receiver applies them:
    the token columns first, then the deltas that carry usage, finishes and errors."""
    out, pos = [], 0
    for rid, index, n in zip(msg.request_ids, msg.indices, msg.num_tokens):
        out.append(pb.TokenDelta(request_id=rid, index=index, token_ids=msg.token_ids[pos:pos + n]))
        pos += n
    out.extend(msg.deltas)
    return out
