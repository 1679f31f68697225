"""What one gateway gets after a step: token columns plus the rare deltas (see SchedulerMessage)."""
from __future__ import annotations

from proto import internal_pb2 as pb
from proto.columns import pack, unpack
from proto.sizes import DELTA_BATCH_BYTES, LOGPROBS_POSITIONS


class Outbox:
    """Token entries in arrival order, so that a stream's tokens stay in order, plus the deltas
    that carry usage, finishes and errors, and logprobs."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.indices: list[int] = []
        self.num_tokens: list[int] = []
        self.offsets: list[int] = []  # output index of each entry's first token
        self.token_ids: list[int] = []
        self.deltas: list[pb.TokenDelta] = []
        self.logprobs: list[pb.Logprobs] = []

    def add(self, request_id: str, index: int, token_ids: list[int], offset: int = 0) -> None:
        self.request_ids.append(request_id)
        self.indices.append(index)
        self.num_tokens.append(len(token_ids))
        self.offsets.append(offset)
        self.token_ids += token_ids

    def appends(self) -> tuple:
        """The columns' append methods, in add()'s order (request id, index, count, offset,
        token): a step streams one token per decode, and binding these once per step spares
        a method call per token."""
        return (self.request_ids.append, self.indices.append, self.num_tokens.append,
                self.offsets.append, self.token_ids.append)

    def to_message(self) -> pb.SchedulerMessage:
        return pb.SchedulerMessage(deltas=self.deltas, logprobs=self.logprobs,
                                   request_ids=self.request_ids, indices=pack(self.indices),
                                   num_tokens=pack(self.num_tokens), token_ids=pack(self.token_ids),
                                   offsets=pack(self.offsets))


def split(msg: pb.SchedulerMessage) -> list[pb.SchedulerMessage]:
    """msg as messages of at most DELTA_BATCH_BYTES of entries each (one larger entry goes
    alone), logprobs cut to LOGPROBS_POSITIONS positions, so that each fits the gateway's bound
    (proto/sizes.py). The order of application stays: all logprobs, then the token entries, then
    the deltas, since a gateway pairs logprobs with tokens that come with or after them."""
    logprobs = [part for lp in msg.logprobs for part in _cut_logprobs(lp)]
    if len(logprobs) == len(msg.logprobs) and msg.ByteSize() <= DELTA_BATCH_BYTES:
        return [msg]
    out, box, size = [], Outbox(), 0

    def fits(n: int) -> None:
        nonlocal box, size
        if size and size + n > DELTA_BATCH_BYTES:
            out.append(box.to_message())
            box, size = Outbox(), 0
        size += n

    for lp in logprobs:
        fits(lp.ByteSize())
        box.logprobs.append(lp)
    tokens, pos = unpack(msg.token_ids), 0
    for rid, index, n, offset in zip(msg.request_ids, unpack(msg.indices).tolist(),
                                     unpack(msg.num_tokens).tolist(), unpack(msg.offsets).tolist()):
        fits(len(rid) + 16 + 4 * n)
        box.add(rid, index, tokens[pos:pos + n].tolist(), offset)
        pos += n
    for delta in msg.deltas:
        fits(delta.ByteSize())
        box.deltas.append(delta)
    out.append(box.to_message())
    out[0].replies.extend(msg.replies)  # replies and info go with the first part
    if msg.HasField("info"):
        out[0].info.CopyFrom(msg.info)
    return out


def _cut_logprobs(lp: pb.Logprobs) -> list[pb.Logprobs]:
    positions = len(lp.token_ids) // 4
    if positions <= LOGPROBS_POSITIONS:
        return [lp]
    parts, k = [], lp.k
    for a in range(0, positions, LOGPROBS_POSITIONS):
        b = min(a + LOGPROBS_POSITIONS, positions)
        parts.append(pb.Logprobs(
            slot=lp.slot, request_id=lp.request_id, index=lp.index, prompt=lp.prompt,
            first_position=lp.first_position + a, k=k, token_ids=lp.token_ids[4 * a:4 * b],
            logprobs=lp.logprobs[4 * a:4 * b], ranks=lp.ranks[4 * a:4 * b],
            top_token_ids=lp.top_token_ids[4 * a * k:4 * b * k],
            top_logprobs=lp.top_logprobs[4 * a * k:4 * b * k]))
    return parts
