"""One grammar-compiler child (structured/check_process.py) of the gateway's check, and its line
protocol: told the vocabulary and the compile bound once, then one spec a line, one answer a
line. The child stops a compile past the bound itself (structured/check_process.py compiles in
a fork); a child that does not answer within the bound and BACKSTOP_S is killed, and started()
starts a fresh one.

The child is started by subprocess (vfork), not by the loop: uvloop's subprocess_exec fork()s
the gateway, which runs gRPC, and gRPC's fork handlers can abort the child before it execs (CI
saw "did not say ready" that way). Its pipes are then handed to the loop. It dies with the
gateway, SIGKILLed or not (structured/check_process.py sets its parent-death signal)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
from typing import Callable

from process_life.lifetime import PARENT_ENV
from structured.spec import Spec

log = logging.getLogger(__name__)
START_TIMEOUT_S = 120.0  # importing torch and xgrammar and loading the vocabulary, once
# The child stops a compile past the bound itself (in a fork it kills); past this much more, the
# child itself is taken for wedged, killed and started again.
BACKSTOP_S = 2.0
TOO_SLOW = "compiling it took longer than"  # how a timeout's answer starts


class CompilerChild:
    def __init__(self, args: list[str], vocabulary: Callable[[], tuple[int, list[int]]],
                 timeout_s: float) -> None:
        self.args = args
        # (vocabulary size, EOS ids), asked when a child is told them: the size is the workers'.
        self.vocabulary = vocabulary
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None
        self._ready = False  # whether this child has its vocabulary and said so
        self._stdout: asyncio.StreamReader | None = None
        self._stdin: asyncio.StreamWriter | None = None
        self._read_transport: asyncio.ReadTransport | None = None
        self._next_id = 0
        self._starting = asyncio.Lock()  # a check and warm()'s background start may both ask

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        """Started and told its vocabulary: a compile needs no start first."""
        return self._ready and self.alive()

    async def spawn(self) -> None:
        """Starts a child's imports now, without waiting for them or for the vocabulary."""
        # Under the lock that started() holds: the gateway's start spawns while a worker's
        # ClusterInfo may already warm the same child, which then found the child's process but
        # not yet its pipes (AttributeError: readiness said SERVING without the child).
        async with self._starting:
            await self._spawn_if_dead()

    async def _spawn_if_dead(self) -> None:
        if not self.alive():
            await self.close()
            await self._spawn()

    async def started(self) -> None:
        """A child that has its vocabulary; RuntimeError when none starts."""
        async with self._starting:
            await self._start()

    async def _start(self) -> None:
        if self.alive() and self._ready:
            return
        await self._spawn_if_dead()
        proc = self.proc
        vocab_size, eos_token_ids = self.vocabulary()
        told = json.dumps({"vocab_size": vocab_size, "eos_token_ids": eos_token_ids,
                           "timeout_s": self.timeout_s}).encode() + b"\n"
        try:
            self._stdin.write(told)
            await self._stdin.drain()
        except OSError:  # a child that died already: its silence below says so
            pass
        try:
            ready = await asyncio.wait_for(self._stdout.readline(), START_TIMEOUT_S)
            if not json.loads(ready or b"{}").get("ready"):
                raise ValueError("it did not say ready")
        except (asyncio.TimeoutError, ValueError) as e:
            await self.close()
            raise RuntimeError(f"the grammar compiler did not start: {e} "
                               f"(exit status {proc.returncode})") from None
        self._ready = True

    async def compile(self, spec: Spec) -> str | None:
        """None when the spec compiles, else why not; RuntimeError when no child starts."""
        await self.started()
        self._next_id += 1
        line = json.dumps({"id": self._next_id, "kind": spec.kind, "value": spec.value,
                           "choices": list(spec.choices), "any_whitespace": spec.any_whitespace})
        try:
            self._stdin.write(line.encode() + b"\n")
            await self._stdin.drain()
            answer = await asyncio.wait_for(self._answer(self._next_id), self.timeout_s + BACKSTOP_S)
        except asyncio.TimeoutError:
            log.warning("the grammar compiler did not answer within %.1f s; it is restarted",
                        self.timeout_s + BACKSTOP_S)
            await self.close()
            return self._too_slow()
        except (OSError, ValueError) as e:  # the child died (e.g. out of memory)
            log.warning("the grammar compiler failed (%s); it is restarted", e)
            await self.close()
            return "the grammar compiler failed on it"
        if answer.get("timed_out"):
            return self._too_slow()
        return answer.get("error")

    def _too_slow(self) -> str:
        return f"{TOO_SLOW} {self.timeout_s:g} s (--max-grammar-compile-seconds)"

    async def _answer(self, wanted: int) -> dict:
        """The answer to spec number wanted: one to an earlier spec, whose asker was cancelled
        before it came, is skipped rather than taken for this one's."""
        while True:
            line = await self._stdout.readline()
            if not line:
                raise ValueError("it exited")
            answer = json.loads(line)
            if answer.get("id") == wanted:
                return answer

    async def _spawn(self) -> None:
        loop = asyncio.get_running_loop()
        # The child sets PR_SET_PDEATHSIG itself (a preexec_fn would make subprocess fork):
        # told this pid, it knows whether the gateway died before it could.
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=dict(os.environ, **{PARENT_ENV: str(os.getpid())}))
        self._stdout = asyncio.StreamReader(limit=1 << 20)
        self._read_transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(self._stdout), self.proc.stdout)
        transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                            self.proc.stdin)
        self._stdin = asyncio.StreamWriter(transport, protocol, None, loop)

    async def close(self) -> None:
        proc, self.proc = self.proc, None
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
