"""Refuses a structured-output spec that does not compile, or takes too long to, before the
request reaches the scheduler. Compiling runs in child processes (gateway/compiler_child.py),
each one spec at a time; past --max-grammar-compile-seconds a child is killed and started again
in the background. A slow spec holds one child, so that with several (--structured-check-
processes) another request's spec is compiled beside it rather than after it; with API keys a
tenant may hold all but one of them, so that one tenant's slow specs never hold every child.
Answers are cached by spec: the same schema is compiled once, and asked twice at once it is
compiled once for both. A child can be spawned before the vocabulary's size is known (spawn()),
so that its imports overlap the workers' start."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

from gateway.compiler_child import TOO_SLOW, CompilerChild
from structured.spec import Spec

__all__ = ["TOO_SLOW", "GrammarChecker"]
log = logging.getLogger(__name__)
_CACHED = 1024


class GrammarChecker:
    def __init__(self, tokenizer_json: Path | None, vocabulary: Callable[[], tuple[int, list[int]]],
                 timeout_s: float = 5.0, processes: int = 2, args: list[str] | None = None) -> None:
        """args: the child's command line (tests run a stand-in), by default the real compiler's."""
        args = args or [sys.executable, "-m", "structured.check_process", str(tokenizer_json)]
        self.processes = processes
        self._children = [CompilerChild(args, vocabulary, timeout_s) for _ in range(processes)]
        self._idle: asyncio.Queue[CompilerChild] = asyncio.Queue()
        for child in self._children:
            self._idle.put_nowait(child)
        self._answers: OrderedDict[str, str | None] = OrderedDict()
        self._compiling: dict[str, asyncio.Future] = {}  # key -> its one compile, until answered
        self._held: dict[str, int] = {}  # tenant -> children its compiles hold
        self._freed = asyncio.Condition()
        self._restarts: set[asyncio.Task] = set()

    async def check(self, spec: Spec, tenant: str | None = None) -> str | None:
        """None when the spec compiles; otherwise why not. tenant (with API keys) bounds the
        children one tenant's compiles hold at once. RuntimeError when no child starts."""
        key = spec.key()
        if key in self._answers:
            self._answers.move_to_end(key)
            return self._answers[key]
        compiling = self._compiling.get(key)
        if compiling is None:
            compiling = asyncio.ensure_future(self._compile(key, spec, tenant))
            self._compiling[key] = compiling
            compiling.add_done_callback(lambda done: self._answered(key, done))
        # Shielded: an asker that hangs up leaves the compile to finish for the others, and its
        # child's answer read, not left in the pipe for the next spec.
        return await asyncio.shield(compiling)

    def _answered(self, key: str, done: asyncio.Future) -> None:
        self._compiling.pop(key, None)
        if not done.cancelled():
            done.exception()  # retrieved, should every asker have gone

    async def _compile(self, key: str, spec: Spec, tenant: str | None) -> str | None:
        async with self._tenant_share(tenant):
            child = await self._idle.get()
            try:
                answer = await child.compile(spec)
            except BaseException:
                self._idle.put_nowait(child)
                raise
            if answer is not None and answer.startswith(TOO_SLOW):
                self._restart(child)  # killed: ready again in the background, then idle
            else:
                self._idle.put_nowait(child)
        # A timeout is remembered too: the same pattern sent again must not cost the wait again.
        self._answers[key] = answer
        if len(self._answers) > _CACHED:
            self._answers.popitem(last=False)
        return answer

    @contextlib.asynccontextmanager
    async def _tenant_share(self, tenant: str | None):
        """At most all children but one held by one tenant's compiles (none bound without keys,
        where every client is the same tenant)."""
        if tenant is None or self.processes < 2:
            yield
            return
        async with self._freed:
            await self._freed.wait_for(lambda: self._held.get(tenant, 0) < self.processes - 1)
            self._held[tenant] = self._held.get(tenant, 0) + 1
        try:
            yield
        finally:
            async with self._freed:
                self._held[tenant] -= 1
                if not self._held[tenant]:
                    del self._held[tenant]
                self._freed.notify_all()

    def _restart(self, child: CompilerChild) -> None:
        async def restart():
            try:
                await child.started()
            except RuntimeError as e:  # the next check on it tries again, and answers UNAVAILABLE
                log.warning("%s", e)
            finally:
                self._idle.put_nowait(child)
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
        for task in list(self._restarts):
            task.cancel()
        for child in self._children:
            await child.close()
