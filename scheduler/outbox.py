"""What one gateway gets after a step: token columns plus the rare deltas (see SchedulerMessage)."""
from __future__ import annotations

from proto import internal_pb2 as pb
from proto.columns import pack


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

    def add_one(self, request_id: str, index: int, token_id: int, offset: int) -> None:
        """A decode's token: the common case, without a list per token."""
        self.request_ids.append(request_id)
        self.indices.append(index)
        self.num_tokens.append(1)
        self.offsets.append(offset)
        self.token_ids.append(token_id)

    def to_message(self) -> pb.SchedulerMessage:
        return pb.SchedulerMessage(deltas=self.deltas, logprobs=self.logprobs,
                                   request_ids=self.request_ids, indices=pack(self.indices),
                                   num_tokens=pack(self.num_tokens), token_ids=pack(self.token_ids),
                                   offsets=pack(self.offsets))
