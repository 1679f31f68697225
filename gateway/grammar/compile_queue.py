"""Who gets the next free grammar compiler child: a fair queue per client (the tenant with API
keys, the peer's address without), with a bounded wait.

Work-conserving: a client alone may hold every child. When several wait, a freed child goes to
the waiting client that holds the fewest (ties: the one whose oldest request has waited
longest, a client whose specs time out last), so one client's flood of specs delays another
client's spec by at most one compile in progress (--max-grammar-compile-seconds), never by the
flood's length. A client whose spec timed out holds at most one child for a while
(slow_cooldown_s), and a child restarting after it (one that did not answer at all) counts as
held by that client until it is ready again. Nobody waits longer than the queue's bound: past
it, or with too many specs of its own already waiting, a request gets CompilerBusy (429 /
RESOURCE_EXHAUSTED) rather than a place in a queue without end."""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class CompilerBusy(Exception):
    """No compiler for this request within the bound: the client should retry later."""


@dataclass
class _Client:
    waiting: deque = field(default_factory=deque)  # (since, future), oldest first
    held: int = 0
    capped_until: float = 0.0  # monotonic: until then at most one child


class FairQueue(Generic[T]):
    def __init__(self, items: list[T], wait_s: float, max_waiting: int = 32,
                 slow_cooldown_s: float = 60.0, warm: Callable[[T], bool] = lambda item: True) -> None:
        """warm(item): whether an item is ready now; a warm one is handed out before a cold one
        (a child not started yet takes seconds)."""
        self.size = len(items)
        self.warm = warm
        self.wait_s = wait_s
        self.max_waiting = max_waiting  # one client's specs waiting at once
        self.slow_cooldown_s = slow_cooldown_s
        self._idle: deque[T] = deque(items)
        self._clients: dict[str, _Client] = {}

    async def acquire(self, client: str) -> T:
        """A free item for client, within wait_s; CompilerBusy past it."""
        c = self._clients.setdefault(client, _Client())
        if len(c.waiting) >= self.max_waiting:
            self._forget(client)
            raise CompilerBusy(f"{len(c.waiting)} structured-output specs of this client already "
                               "wait for a grammar compiler; retry later")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        entry = (time.monotonic(), future)
        c.waiting.append(entry)
        self._dispatch()
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.wait_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            if future.done() and not future.cancelled():  # granted as the wait ended: give it back
                self.release(client, future.result())
            else:
                future.cancel()
                c.waiting.remove(entry)
                self._forget(client)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise CompilerBusy(f"no grammar compiler was free within {self.wait_s:g} s "
                               "(--max-grammar-queue-seconds): the structured-output specs of "
                               "other requests hold them; retry later") from None

    def release(self, client: str, item: T) -> None:
        """client is done with item (a child it left restarting: once it is ready again, so that
        the client is charged the restart too)."""
        c = self._clients.get(client)
        if c is not None:
            c.held -= 1
            self._forget(client)
        self._idle.append(item)
        self._dispatch()

    def cap(self, client: str) -> None:
        """client's spec timed out: one child at a time for it, for slow_cooldown_s."""
        c = self._clients.setdefault(client, _Client())
        c.capped_until = time.monotonic() + self.slow_cooldown_s
        asyncio.get_running_loop().call_later(self.slow_cooldown_s + 0.01, self._uncap, client)

    def _uncap(self, client: str) -> None:
        # Its waiters may take a free child again, with nothing else to wake them.
        self._forget(client)
        self._dispatch()

    def held(self, client: str) -> int:
        c = self._clients.get(client)
        return c.held if c is not None else 0

    def waiting(self, client: str) -> int:
        c = self._clients.get(client)
        return len(c.waiting) if c is not None else 0

    def _limit(self, c: _Client, now: float) -> int:
        return 1 if c.capped_until > now else self.size

    def _dispatch(self) -> None:
        now = time.monotonic()
        while self._idle:
            # Fewest held first; between equals, a client whose specs time out goes last.
            ready = [(c.held, c.capped_until > now, c.waiting[0][0], name)
                     for name, c in self._clients.items() if c.waiting and c.held < self._limit(c, now)]
            if not ready:
                return
            name = min(ready)[-1]
            c = self._clients[name]
            _, future = c.waiting.popleft()
            c.held += 1
            item = next((i for i in self._idle if self.warm(i)), self._idle[0])
            self._idle.remove(item)
            future.set_result(item)

    def _forget(self, client: str) -> None:
        """Drops a client's entry once it holds and waits for nothing (and is not capped): the
        table grows with the clients active now, not every one ever seen."""
        c = self._clients.get(client)
        if c is not None and not c.waiting and c.held <= 0 and c.capped_until <= time.monotonic():
            del self._clients[client]
