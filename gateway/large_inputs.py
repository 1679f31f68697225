"""Work in proportion to a request's size, kept off the event loop and bounded.

Tokenizing, rendering and decoding a large input, and building a Tokenize answer of a token
each (a 1 MB prompt of U+10FFFF is a million tokens, strings and Offsets), take seconds; on the
loop they would stall every stream past the scheduler link's silence check. Such work runs on
threads of its own pool, at most --max-large-input-jobs at once (tokenizers' batch calls and the
chunked answer building below leave the GIL to the loop in between); a job that waits longer
than --large-input-wait-seconds for its turn gets RESOURCE_EXHAUSTED (HTTP 429).
"""
from __future__ import annotations

import asyncio
import ctypes
import functools
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
    """Every slot stayed taken for the whole wait."""


class LargeJobs:
    def __init__(self, slots: int, wait: float):
        self.slots = slots
        self.wait = wait
        self._free = asyncio.Semaphore(slots)
        self._pool = ThreadPoolExecutor(slots, thread_name_prefix="pagoda-large")

    async def run(self, request, fn, *args, **kwargs):
        """fn(*args, **kwargs), inline for a small request, else on the pool when a slot frees."""
        if request.ByteSize() <= INLINE_REQUEST_BYTES:
            return fn(*args, **kwargs)
        try:
            # A free slot is taken at once (wait_for with no time left would not even try).
            await (self._free.acquire() if not self._free.locked()
                   else asyncio.wait_for(self._free.acquire(), self.wait))
        except asyncio.TimeoutError:
            raise Busy(f"{self.slots} large requests are being tokenized or answered and this one "
                       f"waited {self.wait:g} s for its turn (--max-large-input-jobs); retry "
                       "later") from None
        loop = asyncio.get_running_loop()
        job = self._pool.submit(_trimmed, functools.partial(fn, *args, **kwargs))
        # The slot frees when the thread is done, not when a cancelled caller stops waiting.
        job.add_done_callback(lambda _: _call_soon(loop, self._free.release))
        return await asyncio.wrap_future(job)

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


def tokenize_response(text: str, ids: list[int], offsets: list[tuple[int, int]],
                      tokenizer: TextTokenizer) -> pagoda_pb2.TokenizeResponse:
    out = pagoda_pb2.TokenizeResponse(prompt=text)
    for at in range(0, len(ids), _CHUNK):
        part = ids[at:at + _CHUNK]
        out.token_ids.extend(part)
        out.tokens.extend([tokenizer.id_to_token(i) for i in part])
        out.offsets.extend([pagoda_pb2.Offset(start=a, end=b) for a, b in offsets[at:at + _CHUNK]])
    return out
