"""What one gateway gets after a step: token columns plus the rare deltas (see SchedulerMessage)."""
from __future__ import annotations

import numpy as np

from proto import internal_pb2 as pb
from proto.columns import pack


class Outbox:
    """Entries arrive one by one (first tokens, finishes) or as whole columns (a quiet step's
    plain tokens). They are kept as segments in arrival order, so that a stream's tokens stay in
    order, and are joined once when the message is built."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.deltas: list[pb.TokenDelta] = []
        self.logprobs: list[pb.Logprobs] = []
        self._segments: list[tuple] = []  # (indices, num_tokens, token_ids): lists or arrays
        self._open: tuple[list, list, list] | None = None

    def add(self, request_id: str, index: int, token_ids: list[int]) -> None:
        if self._open is None:
            self._open = ([], [], [])
            self._segments.append(self._open)
        indices, num_tokens, tokens = self._open
        self.request_ids.append(request_id)
        indices.append(index)
        num_tokens.append(len(token_ids))
        tokens += token_ids

    def add_columns(self, request_ids: list[str], indices: np.ndarray, token_ids: np.ndarray) -> None:
        """One token for each of request_ids."""
        self._open = None
        self.request_ids += request_ids
        self._segments.append((indices, np.ones(len(request_ids), dtype=np.int32), token_ids))

    def to_message(self) -> pb.SchedulerMessage:
        columns = [b""] * 3
        if self._segments:
            columns = [pack(np.concatenate([np.asarray(s[k], dtype=np.int32) for s in self._segments]))
                       for k in range(3)]
        return pb.SchedulerMessage(deltas=self.deltas, logprobs=self.logprobs,
                                   request_ids=self.request_ids,
                                   indices=columns[0], num_tokens=columns[1], token_ids=columns[2])
