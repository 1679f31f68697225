"""What one gateway gets after a step, and its cut into messages the gateway accepts. The
encoding is the token stream's own (proto/token_stream.py)."""
from __future__ import annotations

from proto import internal_pb2 as pb
from proto.sizes import DELTA_BATCH_BYTES, LOGPROBS_POSITIONS
from proto.token_stream import Writer, updates


class Outbox(Writer):
    """One gateway's token entries, deltas and logprobs since the last send."""


class Outboxes(dict):
    """Each gateway's outbox, made on first use: `outboxes[gateway]`."""

    def __missing__(self, gateway: bytes) -> Outbox:
        box = self[gateway] = Outbox()
        return box


def split(msg: pb.SchedulerMessage) -> list[pb.SchedulerMessage]:
    """msg as messages of at most DELTA_BATCH_BYTES of entries each (one larger entry goes
    alone), logprobs cut to LOGPROBS_POSITIONS positions, so that each fits the gateway's bound
    (proto/sizes.py). The order of application stays: all logprobs, then the updates in the
    decoder's order, each whole (a beam's output with its finish stays one), since a gateway
    pairs logprobs with tokens that come with or after them."""
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
    for update in updates(msg):
        fits(update.wire_bytes())
        box.put(update)
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
            request_id=lp.request_id, index=lp.index, prompt=lp.prompt,
            first_position=lp.first_position + a, k=k, token_ids=lp.token_ids[4 * a:4 * b],
            logprobs=lp.logprobs[4 * a:4 * b], ranks=lp.ranks[4 * a:4 * b],
            top_token_ids=lp.top_token_ids[4 * a * k:4 * b * k],
            top_logprobs=lp.top_logprobs[4 * a * k:4 * b * k]))
    return parts
