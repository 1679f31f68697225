"""What one gateway gets after a step: token columns plus the rare deltas (see SchedulerMessage)."""
from __future__ import annotations

from dataclasses import dataclass, field

from proto import internal_pb2 as pb


@dataclass
class Outbox:
    request_ids: list[str] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    deltas: list[pb.TokenDelta] = field(default_factory=list)

    def to_message(self) -> pb.SchedulerMessage:
        return pb.SchedulerMessage(deltas=self.deltas, request_ids=self.request_ids,
                                   indices=self.indices, num_tokens=self.num_tokens,
                                   token_ids=self.token_ids)
