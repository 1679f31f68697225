"""Refuses a structured-output spec that does not compile, or takes too long to, before the
request reaches the scheduler. Compiling runs in a child process (structured/check_process.py),
one spec at a time; past --max-grammar-compile-seconds the child is killed (and started again for
the next spec), so a pathological pattern costs its own request a bounded wait and nobody else
anything. Answers are cached by spec: the same schema is compiled once. The child can be spawned
before the vocabulary's size is known (spawn()), so that its imports overlap the workers' start.

The child is started by subprocess (vfork), not by the loop: uvloop's subprocess_exec fork()s
the gateway, which runs gRPC, and gRPC's fork handlers can abort the child before it execs (CI
saw "did not say ready" that way). Its pipes are then handed to the loop."""
from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

from structured.spec import Spec

log = logging.getLogger(__name__)
_START_TIMEOUT_S = 120.0  # importing torch and xgrammar and loading the vocabulary, once
_CACHED = 1024
TOO_SLOW = "compiling it took longer than"  # how a timeout's answer starts


class GrammarChecker:
    def __init__(self, tokenizer_json: Path, vocabulary: Callable[[], tuple[int, list[int]]],
                 timeout_s: float = 5.0) -> None:
        self.args = [sys.executable, "-m", "structured.check_process", str(tokenizer_json)]
        # (vocabulary size, EOS ids), asked when a child is told them: the size is the workers'.
        self.vocabulary = vocabulary
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        self._ready = False  # whether this child has its vocabulary and said so
        self._stdout: asyncio.StreamReader | None = None
        self._stdin: asyncio.StreamWriter | None = None
        self._read_transport: asyncio.ReadTransport | None = None
        self._lock = asyncio.Lock()
        self._answers: OrderedDict[str, str | None] = OrderedDict()
        self._next_id = 0

    async def check(self, spec: Spec) -> str | None:
        """None when the spec compiles; otherwise why not."""
        key = spec.key()
        if key in self._answers:
            self._answers.move_to_end(key)
            return self._answers[key]
        async with self._lock:
            if key in self._answers:
                return self._answers[key]
            answer = await self._compile(spec)
        # A timeout is remembered too: the same pattern sent again must not cost the wait again.
        self._answers[key] = answer
        if len(self._answers) > _CACHED:
            self._answers.popitem(last=False)
        return answer

    async def spawn(self) -> None:
        """Starts a child's imports now, without waiting for them or for the vocabulary."""
        async with self._lock:
            if not self._alive():
                await self.close()
                try:
                    await self._spawn()
                except OSError as e:  # the first check tries again, and answers UNAVAILABLE
                    log.warning("the structured-output check's compiler did not start: %s", e)

    async def warm(self) -> None:
        """Starts the child ahead of the first check; a child that cannot start is only logged
        here (the first check tries again and answers UNAVAILABLE)."""
        async with self._lock:
            started = time.perf_counter()
            try:
                await self._started()
            except RuntimeError as e:
                log.warning("%s", e)
                return
            log.info("the structured-output check's compiler is ready (%.1f s)", time.perf_counter() - started)

    async def _compile(self, spec: Spec):
        await self._started()
        self._next_id += 1
        line = json.dumps({"id": self._next_id, "kind": spec.kind, "value": spec.value,
                           "choices": list(spec.choices), "any_whitespace": spec.any_whitespace})
        try:
            self._stdin.write(line.encode() + b"\n")
            await self._stdin.drain()
            answer = json.loads(await asyncio.wait_for(self._stdout.readline(), self.timeout_s))
        except asyncio.TimeoutError:
            log.warning("a grammar took longer than %.1f s to compile; its compiler is restarted",
                        self.timeout_s)
            await self.close()
            return (f"{TOO_SLOW} {self.timeout_s:g} s "
                    "(--max-grammar-compile-seconds)")
        except (OSError, ValueError) as e:  # the child died (e.g. out of memory)
            log.warning("the grammar compiler failed (%s); it is restarted", e)
            await self.close()
            return "the grammar compiler failed on it"
        return answer.get("error")

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    async def _started(self) -> None:
        alive = self._alive()
        if alive and self._ready:
            return
        if not alive:
            await self.close()
            await self._spawn()
        proc = self._proc
        vocab_size, eos_token_ids = self.vocabulary()
        told = json.dumps({"vocab_size": vocab_size, "eos_token_ids": eos_token_ids}).encode() + b"\n"
        try:
            self._stdin.write(told)
            await self._stdin.drain()
        except OSError:  # a child that died already: its silence below says so
            pass
        try:
            ready = await asyncio.wait_for(self._stdout.readline(), _START_TIMEOUT_S)
            if not json.loads(ready or b"{}").get("ready"):
                raise ValueError("it did not say ready")
        except (asyncio.TimeoutError, ValueError) as e:
            await self.close()
            raise RuntimeError(f"the grammar compiler did not start: {e} "
                               f"(exit status {proc.returncode})") from None
        self._ready = True

    async def _spawn(self) -> None:
        loop = asyncio.get_running_loop()
        self._proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._stdout = asyncio.StreamReader(limit=1 << 20)
        self._read_transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(self._stdout), self._proc.stdout)
        transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                            self._proc.stdin)
        self._stdin = asyncio.StreamWriter(transport, protocol, None, loop)

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        self._ready = False
        stdin, self._stdin = self._stdin, None
        read, self._read_transport = self._read_transport, None
        self._stdout = None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        for transport in (stdin, read):  # each closes its pipe
            if transport is not None:
                transport.close()
        await asyncio.to_thread(proc.wait)  # killed: returns at once, and reaps it
