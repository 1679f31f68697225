"""Slots: the names of one worker's sequences in plans and results, so that a plan carries a
number rather than a sequence's whole state once the worker holds it.

A released slot is reused only once every plan sent before its release has come back, so a result
never names the wrong sequence.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.request import Request


class Slots:
    def __init__(self) -> None:
        self.table: list[Request | None] = []
        self.free: list[int] = []
        self.released: list[tuple[int, int]] = []  # (last plan sent, slot)
        self.dropped: list[int] = []               # slots the next plan makes the worker forget

    def assign(self, req: Request) -> None:
        """req is new to the worker in the plan being sent."""
        if self.free:
            req.slot = self.free.pop()
            self.table[req.slot] = req
        else:
            req.slot = len(self.table)
            self.table.append(req)
        req.on_worker = True

    def release(self, req: Request, last_step_id: int) -> None:
        """The worker forgets req (the next plan says so); its slot waits for the plans up to
        last_step_id to come back."""
        if req.on_worker:
            self.dropped.append(req.slot)
            self.table[req.slot] = None
            self.released.append((last_step_id, req.slot))
            req.slot = -1
            req.on_worker = False

    def reuse(self, step_id: int) -> None:
        """The result of step_id is back: slots released by then are free."""
        keep = []
        for sent, slot in self.released:
            if sent <= step_id:
                self.free.append(slot)
            else:
                keep.append((sent, slot))
        self.released = keep

    def take_dropped(self) -> list[int]:
        """The slots for the next plan to drop (put back with give_back if none goes)."""
        dropped, self.dropped = self.dropped, []
        return dropped

    def give_back(self, dropped: list[int]) -> None:
        self.dropped = dropped

    def clear(self) -> None:
        self.__init__()
