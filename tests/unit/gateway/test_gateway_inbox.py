"""The inbox of a request whose reader answers only at the end (unary Generate, a non-streamed
HTTP answer): plain tokens wait unread without waking it; news, half the unread bound, and a
failure wake it; the first tokens' arrival is kept for the time to first token."""
from __future__ import annotations

import asyncio
import time

from gateway.inbox import Inbox
from proto import internal_pb2 as ipb
from proto.token_stream import Update


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _waiting(inbox: Inbox) -> asyncio.Future:
    """A reader blocked in inbox.get()."""
    reader = asyncio.ensure_future(inbox.get())
    await _turns()
    return reader


def test_a_whole_answer_reader_sleeps_through_plain_tokens_and_wakes_for_the_finish(run):
    async def body():
        inbox = Inbox("r", limit=256, whole=True)
        reader = await _waiting(inbox)
        for offset in range(20):
            assert inbox.put(Update("r", 0, offset, [100 + offset]))
            await _turns(1)
        assert not reader.done()
        assert len(inbox) == 20
        assert inbox.put(Update.of_news(ipb.TokenDelta(request_id="r", offset=20, finish=ipb.LENGTH)))
        merged = await asyncio.wait_for(reader, 5)
        assert list(merged.token_ids) == list(range(100, 120))
        finish = await asyncio.wait_for(inbox.get(), 5)
        assert finish.finish == ipb.LENGTH and len(inbox) == 0
    run(body())


def test_a_streaming_reader_wakes_for_each_step(run):
    async def body():
        inbox = Inbox("r", limit=256)
        reader = await _waiting(inbox)
        assert inbox.put(Update("r", 0, 0, [5]))
        assert list((await asyncio.wait_for(reader, 5)).token_ids) == [5]
    run(body())


def test_a_whole_answer_reader_wakes_at_half_the_unread_bound(run):
    async def body():
        inbox = Inbox("r", limit=10, whole=True)
        reader = await _waiting(inbox)
        for offset in range(4):
            assert inbox.put(Update("r", 0, offset, [offset]))
        await _turns()
        assert not reader.done()
        assert inbox.put(Update("r", 0, 4, [4]))  # 5 of 10 unread
        assert list((await asyncio.wait_for(reader, 5)).token_ids) == [0, 1, 2, 3, 4]
        assert len(inbox) == 0
    run(body())


def test_a_whole_answer_reader_wakes_for_logprobs_and_for_a_failure(run):
    async def body():
        inbox = Inbox("r", limit=256, whole=True)
        reader = await _waiting(inbox)
        assert inbox.put(ipb.Logprobs(request_id="r"))
        assert isinstance(await asyncio.wait_for(reader, 5), ipb.Logprobs)
        reader = await _waiting(inbox)
        inbox.fail("UNAVAILABLE", "gone")
        item = await asyncio.wait_for(reader, 5)
        assert item.finish == ipb.ERROR and item.news.error.code == "UNAVAILABLE"
    run(body())


def test_the_first_tokens_arrival_is_kept_per_index_whenever_they_are_read(run):
    async def body():
        inbox = Inbox("r", limit=256, n=2, whole=True)
        before = time.monotonic()
        assert inbox.put(Update("r", 1, 0, [9]))
        between = time.monotonic()
        await asyncio.sleep(0.05)
        later = time.monotonic()
        assert inbox.put(Update("r", 1, 1, [10]))
        assert inbox.put(Update("r", 0, 0, [11]))
        assert inbox.first_token_at(0) >= later > between
        assert before <= inbox.first_token_at(1) <= between
        assert Inbox("q", limit=4).first_token_at(0) is None
    run(body())
