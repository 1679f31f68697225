"""The gateway's structured-output check as one owner: its compiler children's start (spawned
while the workers load, given the vocabulary once the scheduler names its size), and whose turn
a spec is compiled in (the tenant with API keys, else the peer: gateway/grammar/compile_queue.py)."""
from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Callable

from gateway.grammar import grammar_check
from gateway.bounds.edge import EdgeConfig
from gateway.grammar.grammar_check import GrammarChecker
from gateway.tokenizer import TextTokenizer


class GrammarService:
    def __init__(self, tokenizer: TextTokenizer, vocab_size: Callable[[], int],
                 edge: EdgeConfig, keyed: bool) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout = edge.max_grammar_compile_seconds
        self.processes = edge.structured_check_processes
        self.queue_s = edge.max_grammar_queue_seconds
        self.keyed = keyed  # with API keys the tenant is the client; without, the peer
        self.checker: GrammarChecker | None = None  # made by spawn or warm, else on first use
        self._warming: asyncio.Task | None = None
        self._spawning: asyncio.Task | None = None

    def _checker(self) -> GrammarChecker:
        if self.checker is None:
            self.checker = GrammarChecker(
                self.tokenizer.source or _tokenizer_file(self.tokenizer),
                lambda: (self.vocab_size(), self.tokenizer.eos_token_ids or [0]),
                self.timeout, self.processes, queue_s=self.queue_s)
        return self.checker

    def spawn(self) -> asyncio.Task:
        """Starts the compiler children importing (2.1 s of torch and xgrammar on a Zen 2 EPYC)
        while the workers load; warm gives them the vocabulary later."""
        if self._spawning is None:
            self._spawning = asyncio.create_task(self._checker().spawn())
        return self._spawning

    def warm(self) -> asyncio.Task:
        """Makes the children ready in the background once the vocabulary's size is known:
        loading it takes seconds (2.7 s for SmolLM2 on a Zen 2 EPYC, imports included), which
        the first structured request would otherwise wait. The task is done once the children
        are ready or failed to start."""
        if self._warming is None:
            self._warming = asyncio.create_task(self._checker().warm())
        return self._warming

    async def error(self, spec, tenant: str) -> str | None:
        """Why the spec does not compile (or not within --max-grammar-compile-seconds); None if
        it does. Raises grammar_check.CompilerBusy when no child is free in time, RuntimeError
        when none can start."""
        client = tenant if self.keyed else grammar_check.CLIENT.get()
        return await self._checker().check(spec, client)

    async def close(self) -> None:
        for task in (self._spawning, self._warming):
            if task is not None:
                task.cancel()
        if self.checker is not None:
            await self.checker.close()


def _tokenizer_file(tokenizer: TextTokenizer) -> Path:
    """A tokenizer built in memory (tests) gets a file for the grammar compiler to read."""
    fd, name = tempfile.mkstemp(prefix="pagoda-tokenizer-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(tokenizer.tokenizer.to_str())
    return Path(name)
