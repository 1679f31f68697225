"""The token stream from the scheduler to a gateway (SchedulerMessage): its one encoder (`Writer`)
and its one decoder (`Columns`, `updates`), used by both ends and by the scheduler's splitting.

On the wire every token travels in the columns: entry i is num_tokens[i] tokens of token_ids,
in order, for the sequence (request_ids[i], indices[i]), the first of them that sequence's output
token offsets[i]. `deltas` carry what is rare and never a token: usage figures (with a sequence's
first tokens), finishes, errors, a beam's cumulative logprob. A receiver applies the logprobs,
then the column entries, then the deltas.

Decoded, a message is a list of `Update`s, what one message tells one sequence, in the order to
apply them: one per column entry, with the delta that continues that entry's sequence in the same
message joined to it (first tokens and their usage, last tokens and their finish), then one per
delta left over (errors among them). A beam search's whole outputs, each with its finish, are
thus one update each, as the gateway shows and counts them, and so is a fake scheduler's
"tokens and finish" step.
"""
from __future__ import annotations

import numpy as np

from proto import internal_pb2 as pb
from proto.columns import pack, unpack

# Per column entry beyond its tokens: index, count and offset (int32 each) and the id's framing.
ENTRY_OVERHEAD = 16


class Update:
    """What one message tells one sequence: tokens (`offset` is the first one's output index)
    and/or news (a TokenDelta without tokens: usage, finish, error). A plain step is tokens
    alone; a news-only update's offset is the news's own."""
    __slots__ = ("request_id", "index", "offset", "token_ids", "news")

    def __init__(self, request_id: str, index: int, offset: int, token_ids: list[int],
                 news: pb.TokenDelta | None = None) -> None:
        self.request_id, self.index, self.offset = request_id, index, offset
        self.token_ids, self.news = token_ids, news

    @classmethod
    def of_news(cls, news: pb.TokenDelta) -> Update:
        return cls(news.request_id, news.index, news.offset, [], news)

    @property
    def finish(self) -> int:
        return self.news.finish if self.news is not None else pb.NOT_FINISHED

    def wire_bytes(self) -> int:
        """About what it costs in a message: splitting (scheduler/outbox.py) counts this."""
        tokens = len(self.request_id) + ENTRY_OVERHEAD + 4 * len(self.token_ids) if self.token_ids else 0
        return tokens + (self.news.ByteSize() if self.news is not None else 0)


class Writer:
    """Builds one SchedulerMessage's stream: token entries in arrival order (a stream's tokens
    stay in order), the deltas, and logprobs."""

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
        tokens: an extend): a step streams one token per decode, and binding these once per
        step spares a method call per token."""
        return (self.request_ids.append, self.indices.append, self.num_tokens.append,
                self.offsets.append, self.token_ids.extend)

    def put(self, update: Update) -> None:
        """An update as it was decoded: its tokens an entry, its news a delta after them."""
        if update.token_ids:
            self.add(update.request_id, update.index, update.token_ids, update.offset)
        if update.news is not None:
            self.deltas.append(update.news)

    def to_message(self) -> pb.SchedulerMessage:
        return pb.SchedulerMessage(deltas=self.deltas, logprobs=self.logprobs, request_ids=self.request_ids,
                                   indices=pack(self.indices), num_tokens=pack(self.num_tokens),
                                   token_ids=pack(self.token_ids), offsets=pack(self.offsets))


class Columns:
    """A message's token columns as arrays, without a copy; ValueError when they do not line up."""
    __slots__ = ("request_ids", "indices", "num_tokens", "offsets", "token_ids", "starts")

    def __init__(self, msg: pb.SchedulerMessage) -> None:
        self.request_ids = msg.request_ids
        self.indices, self.num_tokens, self.offsets, self.token_ids = (unpack(c) for c in (
            msg.indices, msg.num_tokens, msg.offsets, msg.token_ids))
        n = len(self.request_ids)
        if not n == len(self.indices) == len(self.num_tokens) == len(self.offsets) \
                or (n and self.num_tokens.min() < 0) \
                or int(self.num_tokens.sum(dtype=np.int64)) != len(self.token_ids):
            raise ValueError("a SchedulerMessage's token columns do not line up")
        self.starts = np.zeros(len(self.num_tokens) + 1, dtype=np.int64)
        np.cumsum(self.num_tokens, out=self.starts[1:])

    def __len__(self) -> int:
        return len(self.request_ids)

    def entry_max(self) -> np.ndarray:
        """Each entry's largest token id (-1 for an entry of none): one pass over the column."""
        out = np.full(len(self), -1, dtype=np.int64)
        full = self.num_tokens > 0
        if full.any():
            out[full] = np.maximum.reduceat(self.token_ids, self.starts[:-1][full])
        return out

    def negative(self) -> dict[int, str]:
        """Entries holding a negative index, offset or token id (the fields are unsigned)."""
        if not len(self) or min(self.indices.min(), self.offsets.min(),
                                self.token_ids.min() if len(self.token_ids) else 0) >= 0:
            return {}
        bad = (self.indices < 0) | (self.offsets < 0)
        full = self.num_tokens > 0
        if full.any():
            bad[full] |= np.minimum.reduceat(self.token_ids, self.starts[:-1][full]) < 0
        return {int(i): f"entry {i} of the token columns holds a negative index, offset or token id"
                for i in np.flatnonzero(bad)}


def updates(msg: pb.SchedulerMessage, columns: Columns | None = None,
            skip: dict[int, str] | set[int] = frozenset()) -> list[Update]:
    """msg as Updates, in the order to apply them (above). columns: msg's, already decoded (None:
    decoded here); entries in `skip` (say, malformed) are left out, and an entry of no tokens
    says nothing. A delta joins the last entry of its sequence when it continues it exactly
    (its offset is that entry's end) and holds no error: an error stays
    after the tokens it follows, which the gateway shows before it fails the stream."""
    cols = Columns(msg) if columns is None else columns
    tokens, starts = cols.token_ids.tolist(), cols.starts.tolist()
    out: list[Update] = []
    last: dict[tuple[str, int], Update] = {}
    for i, (rid, index, offset) in enumerate(zip(cols.request_ids, cols.indices.tolist(),
                                                 cols.offsets.tolist())):
        if i in skip or starts[i] == starts[i + 1]:
            continue
        u = Update(rid, index, offset, tokens[starts[i]:starts[i + 1]])
        out.append(u)
        last[(rid, index)] = u
    for d in msg.deltas:
        u = last.get((d.request_id, d.index))
        if u is not None and u.news is None and not d.HasField("error") \
                and d.offset == u.offset + len(u.token_ids):
            u.news = d
            del last[(d.request_id, d.index)]
        else:
            out.append(Update.of_news(d))
    return out
