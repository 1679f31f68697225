"""Refuses a structured-output spec that does not compile, or takes too long to, before the
request reaches the scheduler. Compiling runs in a child process (structured/check_process.py),
one spec at a time; past --max-grammar-compile-seconds the child is killed (and started again for
the next spec), so a pathological pattern costs its own request a bounded wait and nobody else
anything. Answers are cached by spec: the same schema is compiled once."""
from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections import OrderedDict
from pathlib import Path

from structured.spec import Spec

log = logging.getLogger(__name__)
_START_TIMEOUT_S = 120.0  # importing torch and xgrammar and loading the vocabulary, once
_CACHED = 1024
TOO_SLOW = "compiling it took longer than"  # how a timeout's answer starts


class GrammarChecker:
    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int],
                 timeout_s: float = 5.0) -> None:
        self.args = [sys.executable, "-m", "structured.check_process", str(tokenizer_json),
                     str(vocab_size), ",".join(str(i) for i in eos_token_ids)]
        self.timeout_s = timeout_s
        self._proc: asyncio.subprocess.Process | None = None
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

    async def _compile(self, spec: Spec):
        proc = await self._started()
        self._next_id += 1
        line = json.dumps({"id": self._next_id, "kind": spec.kind, "value": spec.value,
                           "choices": list(spec.choices), "any_whitespace": spec.any_whitespace})
        try:
            proc.stdin.write(line.encode() + b"\n")
            await proc.stdin.drain()
            answer = json.loads(await asyncio.wait_for(proc.stdout.readline(), self.timeout_s))
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

    async def _started(self) -> asyncio.subprocess.Process:
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        self._proc = await asyncio.create_subprocess_exec(
            *self.args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=1 << 20)
        try:
            ready = await asyncio.wait_for(self._proc.stdout.readline(), _START_TIMEOUT_S)
            if not json.loads(ready or b"{}").get("ready"):
                raise ValueError("it did not say ready")
        except (asyncio.TimeoutError, ValueError) as e:
            await self.close()
            raise RuntimeError(f"the grammar compiler did not start: {e}") from None
        return self._proc

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
