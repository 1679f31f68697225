"""Decoding helpers for messages whose layout is columnar for speed (see internal.proto)."""
from __future__ import annotations

from proto import internal_pb2 as pb
from proto.columns import unpack_list


def expand_deltas(msg: pb.SchedulerMessage, bad: dict[str, str] | None = None) -> list[pb.TokenDelta]:
    """A SchedulerMessage as one TokenDelta per entry, in the order a receiver applies them:
    the token columns first, then the deltas that carry usage, finishes and errors.

    Columns that do not line up raise ValueError. An entry with a negative index, offset or
    token id raises too, or, given `bad`, is left out and its request id recorded there (why)."""
    indices, num_tokens, token_ids, offsets = (unpack_list(c) for c in (
        msg.indices, msg.num_tokens, msg.token_ids, msg.offsets))
    if not len(msg.request_ids) == len(indices) == len(num_tokens) == len(offsets) \
            or sum(num_tokens) != len(token_ids) or min(num_tokens, default=0) < 0:
        raise ValueError("a SchedulerMessage's token columns do not line up")
    out, pos = [], 0
    for rid, index, n, offset in zip(msg.request_ids, indices, num_tokens, offsets):
        tokens = token_ids[pos:pos + n]
        pos += n
        if min(index, offset, *tokens) < 0:
            why = f"entry {len(out)} of the token columns holds a negative index, offset or token id"
            if bad is None:
                raise ValueError(why)
            bad[rid] = why
            continue
        out.append(pb.TokenDelta(request_id=rid, index=index, token_ids=tokens, offset=offset))
    out.extend(msg.deltas)
    return out
