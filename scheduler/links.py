"""The numbering of the scheduler's messages to each gateway: its epoch and a per-link seq.

A gateway takes a message only if its seq is above the last one it took under the same epoch,
and fails every request in flight when the epoch changes or a seq is skipped
(gateway/scheduler_link/scheduler_client.py). So while this process lives, a link's numbering never starts
again. When a gateway is declared silent and is later heard again, its counter simply goes on.

Why not a new epoch for that link instead: an epoch means "this scheduler restarted and forgot
every request" (proto/internal.proto). Here the scheduler forgot only that gateway's requests,
and said so: each ended with UNAVAILABLE in a message numbered on this link. If that message
was lost, the gap in the numbering fails the gateway's requests anyway. A new epoch would also
fail the requests the gateway sent after it was heard again, and those the scheduler still
holds and runs.

Memory stays bounded: past `max_links` counters, those of links with no lease are forgotten.
A link numbered afresh starts above every seq that a forgotten link reached. A gateway that
comes back after its counter was forgotten then sees a gap, so it fails its requests (its
lapsed lease already aborted them), and it never sees a number repeated.
"""
from __future__ import annotations

MAX_LINKS = 4096


class GatewayLinks:
    def __init__(self, epoch: int, leased, max_links: int = MAX_LINKS) -> None:
        self.epoch = epoch
        self.leased = leased  # the idents holding a lease now (a dict or set, read only)
        self.max_links = max_links
        self.seqs: dict[bytes, int] = {}  # the last seq sent on each link
        self.floor = 0  # the highest seq a forgotten link reached

    def number(self, ident: bytes, msg) -> None:
        """Sets msg's epoch and seq: the next number on ident's link."""
        seq = self.seqs.get(ident)
        if seq is None:
            if len(self.seqs) >= self.max_links:
                self._forget_unleased()
            seq = self.floor
        msg.epoch = self.epoch
        msg.seq = self.seqs[ident] = seq + 1

    def _forget_unleased(self) -> None:
        # Half of them at once, oldest first, so the scan is paid once per many new links.
        unleased = [ident for ident in self.seqs if ident not in self.leased]
        for ident in unleased[:(len(unleased) + 1) // 2]:
            self.floor = max(self.floor, self.seqs.pop(ident))
