"""How many tokens one sequence may propose next: speculation that backs off by itself.

A wrong proposal costs a verification row and gains nothing, so each sequence's draft length
follows what its own proposals came to: after a draft that was accepted in full it grows by
one, up to the worker's k (from the one token it tries after a pause); after one that was cut
short it is the worker's k again. Shrinking it to one more than was accepted (as adaptive draft
lengths do in the literature) paid when a verification row was dear; on the CPU 5 rows of the
projections now cost 1.22x one row, and proposing k after a cut took the repetitive stream of
bench/speculative.py from 1.70x to 1.88x in decode (docs/benchmarks.md). A sequence whose proposals keep failing
outright (two drafts in a row of which nothing was accepted) pauses: it proposes nothing for a
number of decode steps that doubles with every pause, up to MAX_PAUSE, and tries one token
after it, so text that turns repetitive later is still found. While every running sequence is
paused, the scheduler plans ahead again (Scheduler.can_plan). Only the scheduler calls it; it
decides the slots it allocates.

A worker whose proposer sizes each draft itself (method suffix: the draft follows the length
of its match and stops where its continuation is uncertain) is offered k every decode step and
its sequences have no DraftLength (sequence_group._lookahead). Pausing it cost more than it saved: in a replay of bench/speculative.py's
repetitive stream through the proposer with an AVX2 EPYC's measured step costs, 2.06x against
2.32x without pauses (docs/benchmarks.md)."""
from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE = 64  # steps


@dataclass(slots=True)
class DraftLength:
    k: int                 # the next draft's length while not paused
    misses: int = 0        # drafts in a row of which nothing was accepted
    paused: int = 0        # steps left without proposals
    pause: int = 4         # the next pause's length

    @property
    def ready(self) -> bool:
        return not self.paused

    def tick(self) -> None:
        """A decode step planned ahead (it cannot propose): a pause runs down all the same."""
        if self.paused:
            self.paused -= 1

    def next(self) -> int:
        """The lookahead of a decode step that may propose (0 while paused; counts the step)."""
        if self.paused:
            self.tick()
            return 0
        return self.k

    def update(self, proposed: int, accepted: int, most: int) -> None:
        """A result: `proposed` tokens were verified (0: no n-gram matched, nothing learned),
        `accepted` of them kept; `most` is the worker's k."""
        if not proposed:
            return
        if accepted == proposed:
            self.k, self.misses, self.pause = min(most, self.k + 1), 0, 4
            return
        self.k = most
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= 2:
            self.misses, self.k = 0, 1
            self.paused, self.pause = self.pause, min(MAX_PAUSE, 2 * self.pause)
