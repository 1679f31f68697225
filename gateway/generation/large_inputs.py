"""Work in proportion to a request's size, kept off the event loop and bounded.

Tokenizing, rendering and decoding a large input, and building a Tokenize answer of a token
each (a 1 MB prompt of U+10FFFF is a million tokens, strings and Offsets), take seconds; on the
loop they would stall every stream past the scheduler link's silence check. Such work runs on
threads of its own pool, at most --max-large-input-jobs and --max-large-input-bytes of requests
at once (tokenizers' batch calls and the chunked answer building below leave the GIL to the
loop in between); a job that waits longer than --large-input-wait-seconds for room gets
RESOURCE_EXHAUSTED (HTTP 429).
"""
from __future__ import annotations

import asyncio
import ctypes
import functools
from array import array
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from gateway.tokenizer import TextTokenizer
from proto import pagoda_pb2

# Tokenizing a prompt of this size takes about a millisecond; larger ones go to a thread.
INLINE_REQUEST_BYTES = 32 * 1024
# Entries added to a repeated field per call: each call holds the GIL, so a million-token
# answer is built in steps the loop can run between.
_CHUNK = 8192


_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; absent elsewhere


class Busy(Exception):
    """No room came free for the whole wait."""


class LargeJobs:
    """Admits a large request's job while fewer than `slots` run and the request bytes of those
    running stay within `max_bytes` (memory follows them: about 250 bytes per input byte at
    worst); one larger than max_bytes runs alone. Waiters are admitted in order."""

    def __init__(self, slots: int, wait: float, max_bytes: int = 1 << 62):
        self.slots = slots
        self.wait = wait
        self.max_bytes = max_bytes
        self._jobs = self._bytes = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()
        self._pool = ThreadPoolExecutor(slots, thread_name_prefix="pagoda-large")

    async def run(self, request, fn, *args, **kwargs):
        """fn(*args, **kwargs), inline for a small request, else on the pool once admitted."""
        size = request.ByteSize()
        if size <= INLINE_REQUEST_BYTES:
            return fn(*args, **kwargs)
        need = min(size, self.max_bytes)
        await self._admit(need)
        loop = asyncio.get_running_loop()
        job = self._pool.submit(_trimmed, functools.partial(fn, *args, **kwargs))
        # The room frees when the thread is done, not when a cancelled caller stops waiting.
        job.add_done_callback(lambda _: _call_soon(loop, lambda: self._release(need)))
        return await asyncio.wrap_future(job)

    def _fits(self, need: int) -> bool:
        return self._jobs < self.slots and self._bytes + need <= self.max_bytes

    def _take(self, need: int) -> None:
        self._jobs += 1
        self._bytes += need

    async def _admit(self, need: int) -> None:
        if not self._waiters and self._fits(need):
            self._take(need)
            return
        entry = (need, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(entry[1], self.wait)
        except asyncio.TimeoutError:
            raise Busy(f"{self._jobs} large requests of {self._bytes} bytes are being tokenized "
                       f"or answered and this one ({need} bytes) waited {self.wait:g} s for "
                       "room (--max-large-input-jobs, --max-large-input-bytes); retry later") from None
        except BaseException:  # cancelled: room it was given meanwhile goes back
            if entry[1].done() and not entry[1].cancelled():
                self._release(need)
            raise
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    def _release(self, need: int) -> None:
        self._jobs -= 1
        self._bytes -= need
        while self._waiters and self._fits(self._waiters[0][0]):
            need, waiter = self._waiters.popleft()
            if not waiter.done():  # else it timed out or was cancelled
                self._take(need)
                waiter.set_result(None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _trimmed(job):
    """job(), then glibc's free memory handed back to the system: a large job frees about 250
    bytes per input byte (tokenizers' Encoding alone keeps about 160 per token) in its thread's
    arena, which glibc would otherwise keep for good."""
    try:
        return job()
    finally:
        if _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)  # ctypes releases the GIL for it


def _call_soon(loop: asyncio.AbstractEventLoop, fn) -> None:
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # the loop closed meanwhile (shutdown): nothing waits for the slot
        pass


def tokenize_response(text: str, ids: array, offsets: array,
                      tokenizer: TextTokenizer) -> pagoda_pb2.TokenizeResponse:
    """offsets: start and end of each id, interleaved (validate.tokenize_parts)."""
    out = pagoda_pb2.TokenizeResponse(prompt=text)
    for at in range(0, len(ids), _CHUNK):
        part = ids[at:at + _CHUNK]
        out.token_ids.extend(part)
        out.tokens.extend([tokenizer.id_to_token(i) for i in part])
        spans = offsets[2 * at:2 * (at + _CHUNK)]
        out.offsets.extend([pagoda_pb2.Offset(start=a, end=b) for a, b in zip(spans[::2], spans[1::2])])
    return out
