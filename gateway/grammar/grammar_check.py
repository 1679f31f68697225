"""Refuses a structured-output spec that does not compile, or takes too long to, before the
request reaches the scheduler. Compiling runs in child processes (gateway/grammar/compiler_child.py),
each one spec at a time; past --max-grammar-compile-seconds the child kills the fork that
compiles it (a child that does not answer is killed and started again in the background). Who
gets a free child is gateway/grammar/compile_queue.py's: a fair share per client (the tenant with API
keys, the peer's address without), work-conserving, and a wait bounded by
--max-grammar-queue-seconds, past which the request gets RESOURCE_EXHAUSTED / 429 instead of a
place in a queue without end. Verdicts are cached by spec, bounded in bytes (a timeout too: the
same slow spec sent again is refused at once); the same spec asked twice at once by one client
is compiled once for both. A child can be spawned before the vocabulary's size is known
(spawn()), so that its imports overlap the workers' start."""
from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
import time
from pathlib import Path
from typing import Callable

from gateway.grammar.compile_queue import CompilerBusy, FairQueue
from gateway.grammar.compiler_child import TOO_SLOW, CompilerChild
from structured.lru import BytesLru
from structured.spec import Spec

__all__ = ["CLIENT", "TOO_SLOW", "CompilerBusy", "GrammarChecker"]
log = logging.getLogger(__name__)
# Verdicts: a key (64 bytes) and a reason (at most 500): the bytes bound what distinct specs cost.
_CACHED_BYTES = 1 << 20
_CACHED = 4096
_ENTRY_OVERHEAD = 200  # the dict entry, the tuple and two strings' headers, roughly

# Who asks, without API keys: the peer's address, set by the RPC's or HTTP request's handler
# (a context variable, so that it reaches the check through the shared request path untouched).
CLIENT: contextvars.ContextVar[str] = contextvars.ContextVar("grammar_client", default="")


class GrammarChecker:
    def __init__(self, tokenizer_json: Path | None, vocabulary: Callable[[], tuple[int, list[int]]],
                 timeout_s: float = 5.0, processes: int = 2, args: list[str] | None = None,
                 queue_s: float = 10.0) -> None:
        """args: the child's command line (tests run a stand-in), by default the real compiler's.
        queue_s: the longest a spec waits for a free child (--max-grammar-queue-seconds)."""
        args = args or [sys.executable, "-m", "structured.check_process", str(tokenizer_json)]
        self.processes = processes
        self._children = [CompilerChild(args, vocabulary, timeout_s) for _ in range(processes)]
        self.queue: FairQueue[CompilerChild] = FairQueue(list(self._children), queue_s,
                                                         warm=CompilerChild.ready)
        self._answers: BytesLru[tuple[str | None]] = BytesLru(_CACHED_BYTES, _CACHED)
        self._compiling: dict[tuple[str, str], asyncio.Future] = {}  # (client, key) -> its compile
        self._restarts: set[asyncio.Task] = set()

    async def check(self, spec: Spec, client: str = "") -> str | None:
        """None when the spec compiles; otherwise why not. client: whose share of the compilers
        it takes (the tenant, or the peer's address without keys). CompilerBusy when no child
        is free for it in time; RuntimeError when no child starts."""
        key = spec.key()
        cached = self._answers.get(key)
        if cached is not None:
            return cached[0]
        # One compile per client and key: another client's identical spec does not wait in
        # this client's queue.
        asked = (client, key)
        compiling = self._compiling.get(asked)
        if compiling is None:
            compiling = asyncio.ensure_future(self._compile(key, spec, client))
            self._compiling[asked] = compiling
            compiling.add_done_callback(lambda done: self._answered(asked, done))
        # Shielded: an asker that hangs up leaves the compile to finish for the others, and its
        # child's answer read, not left in the pipe for the next spec.
        return await asyncio.shield(compiling)

    def _answered(self, asked: tuple[str, str], done: asyncio.Future) -> None:
        self._compiling.pop(asked, None)
        if not done.cancelled():
            done.exception()  # retrieved, should every asker have gone

    async def _compile(self, key: str, spec: Spec, client: str) -> str | None:
        child = await self.queue.acquire(client)
        try:
            answer = await child.compile(spec)
        except BaseException:
            self.queue.release(client, child)
            raise
        if answer is not None and answer.startswith(TOO_SLOW):
            self.queue.cap(client)
        if not child.alive():
            self._restart(child, client)  # killed: the client holds it until it is ready again
        else:
            self.queue.release(client, child)
        # A timeout is remembered too: the same pattern sent again must not cost the wait again.
        self._answers.put(key, (answer,), len(key) + len((answer or "").encode()) + _ENTRY_OVERHEAD)
        return answer

    def _restart(self, child: CompilerChild, client: str) -> None:
        async def restart():
            try:
                await child.started()
            except RuntimeError as e:  # the next check on it tries again, and answers UNAVAILABLE
                log.warning("%s", e)
            finally:
                self.queue.release(client, child)
        task = asyncio.create_task(restart())
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def spawn(self) -> None:
        """Starts the children's imports now, without waiting for them or for the vocabulary."""
        for child in self._children:
            try:
                await child.spawn()
            except OSError as e:  # the first check tries again, and answers UNAVAILABLE
                log.warning("the structured-output check's compiler did not start: %s", e)

    async def warm(self) -> None:
        """Makes every child ready, before the gateway says it is (readiness waits on this): in
        the background after readiness, loading vocabularies took the cores from the first
        requests. A child that cannot start is only logged here (a check tries again and
        answers UNAVAILABLE)."""
        started = time.perf_counter()
        for child in self._children:
            try:
                await child.started()
            except RuntimeError as e:
                log.warning("%s", e)
        log.info("the structured-output check's %d compilers are ready (%.1f s)", len(self._children),
                 time.perf_counter() - started)

    async def close(self) -> None:
        restarts = list(self._restarts)
        for task in restarts:
            task.cancel()
        await asyncio.gather(*restarts, return_exceptions=True)
        for child in self._children:
            await child.close()
