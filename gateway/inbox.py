"""One request's inbox: what the scheduler sent for it, waiting for its RPC to read.

Bounded: a client that stops reading leaves its handler blocked at `yield` (gRPC flow control),
so the inbox would grow with every step. Past `limit` unread items the request is ended with
RESOURCE_EXHAUSTED and aborted at the scheduler, so a slow reader costs at most `limit` items.

Exactly once: each token entry names the output index of its first token (TokenDelta.offset),
and a finish names how many came before it. An entry that does not continue the stream exactly
means a message was lost or repeated; the request ends with UNAVAILABLE rather than stream a
hole, a repeat, or wait for tokens that will never come.
"""
from __future__ import annotations

import asyncio
from collections import deque

from proto import internal_pb2

_ENDS = (internal_pb2.LENGTH, internal_pb2.STOP, internal_pb2.ABORT)


class Inbox:
    def __init__(self, request_id: str, limit: int) -> None:
        self.request_id = request_id
        self.limit = limit
        self.closed = False  # failed: nothing more goes in
        self._items: deque = deque()
        self._ready = asyncio.Event()
        self._received: dict[int, int] = {}  # index -> output tokens received

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item) -> bool:
        """Queues item; False when the request had to be failed (the caller aborts it)."""
        if self.closed:
            return True
        if len(self._items) >= self.limit:
            self.fail("RESOURCE_EXHAUSTED",
                      f"the client read too slowly: {len(self._items)} responses were waiting "
                      f"unread (--max-unread-deltas {self.limit})")
            return False
        if isinstance(item, internal_pb2.TokenDelta) and (item.token_ids or item.finish in _ENDS):
            got = self._received.get(item.index, 0)
            if item.offset != got:
                self.fail("UNAVAILABLE",
                          f"index {item.index}: expected output token {got} from the scheduler, "
                          f"got {item.offset}: a message was lost or repeated")
                return False
            self._received[item.index] = got + len(item.token_ids)
        self._items.append(item)
        self._ready.set()
        return True

    def fail(self, code: str, message: str) -> None:
        """Ends the request after what is already queued; later items are dropped."""
        if self.closed:
            return
        self.closed = True
        self._items.append(internal_pb2.TokenDelta(
            request_id=self.request_id, finish=internal_pb2.ERROR,
            error=internal_pb2.Error(code=code, message=message)))
        self._ready.set()

    async def get(self):
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()
