"""Speculative decoding's counters for one worker, in vLLM's terms: a draft is one row's
proposals in one step; of its draft tokens, the accepted ones are those the target agreed with
(counted at each position, so the acceptance rate per position shows where runs end)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculationStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_tokens: list[int], num_drafts: list[int]) -> None:
        """One result's columns: each row's run of tokens and how many of them were proposed."""
        per_pos = self.accepted_per_position
        for run, proposed in zip(num_tokens, num_drafts):
            if not proposed:
                continue
            accepted = run - 1
            self.num_drafts += 1
            self.num_draft_tokens += proposed
            self.num_accepted_tokens += accepted
            if len(per_pos) < proposed:
                per_pos += [0] * (proposed - len(per_pos))
            for i in range(accepted):
                per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a speculating row gains a step: its accepted proposals and the target's token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
