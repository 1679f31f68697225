"""One request's inbox: what the scheduler sent for it, waiting for its RPC to read.

Bounded: a client that stops reading leaves its handler blocked at `yield` (gRPC flow control),
so the inbox would grow with every step. Past `limit` unread tokens (a message without tokens
counts as one) the request is ended with RESOURCE_EXHAUSTED and aborted at the scheduler, so a
slow reader costs at most `limit` of them. Plain token updates of one sequence that arrive while
the handler is busy merge into the last one: a handler that is merely slower than the scheduler
(a fast model, a busy gateway) catches up with one response of many tokens instead of
falling behind by one response per step.

Exactly once: each update with tokens names the output index of its first token (its offset),
and a finish names how many came before it. An update that does not continue the stream exactly
means a message was lost or repeated; the request ends with UNAVAILABLE rather than stream a
hole, a repeat, or wait for tokens that will never come.
"""
from __future__ import annotations

import asyncio
from collections import deque

from proto import internal_pb2
from proto.token_stream import Update

_ENDS = (internal_pb2.LENGTH, internal_pb2.STOP, internal_pb2.ABORT)


class Inbox:
    def __init__(self, request_id: str, limit: int, n: int = 1) -> None:
        self.request_id = request_id
        self.limit = limit
        self.n = n  # sequences: an index outside [0, n) is malformed (gateway/scheduler_link/scheduler_checks.py)
        self.closed = False  # failed: nothing more goes in
        self._items: deque = deque()
        self._unread = 0  # tokens, plus 1 per queued message without any
        self._ready = asyncio.Event()
        self._received: dict[int, int] = {}  # index -> output tokens received

    def __len__(self) -> int:
        return self._unread

    def put(self, item) -> bool:
        """Queues item; False when the request had to be failed (the caller aborts it)."""
        if self.closed:
            return True
        weight = _weight(item)
        if self._unread + weight > self.limit:
            self.fail("RESOURCE_EXHAUSTED",
                      f"the client read too slowly: {self._unread} tokens were waiting unread "
                      f"(--max-unread-deltas {self.limit})")
            return False
        if isinstance(item, Update) and (item.token_ids or item.finish in _ENDS):
            got = self._received.get(item.index, 0)
            if item.offset != got:
                self.fail("UNAVAILABLE",
                          f"index {item.index}: expected output token {got} from the scheduler, "
                          f"got {item.offset}: a message was lost or repeated")
                return False
            self._received[item.index] = got + len(item.token_ids)
        self._unread += weight
        last = self._items[-1] if self._items else None
        if _plain(item) and _plain(last) and last.index == item.index:
            last.token_ids.extend(item.token_ids)
            return True
        self._items.append(item)
        self._ready.set()
        return True

    def fail(self, code: str, message: str) -> None:
        """Ends the request after what is already queued; later items are dropped."""
        if self.closed:
            return
        self.closed = True
        self._items.append(Update.of_news(internal_pb2.TokenDelta(
            request_id=self.request_id, finish=internal_pb2.ERROR,
            error=internal_pb2.Error(code=code, message=message))))
        self._ready.set()

    async def get(self):
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        self._unread -= _weight(item)
        return item


def _weight(item) -> int:
    """Unread tokens an item counts for. A finish counts one whatever it carries: an index ends
    once, and a beam search's finishes carry whole outputs, all in one message."""
    if isinstance(item, Update) and item.finish == internal_pb2.NOT_FINISHED:
        return max(1, len(item.token_ids))
    return 1


def _plain(item) -> bool:
    """Only tokens: no news (finish, error, usage figures)."""
    return isinstance(item, Update) and item.news is None and bool(item.token_ids)
