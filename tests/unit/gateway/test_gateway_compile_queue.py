"""The grammar compilers' fair queue (gateway/grammar/compile_queue.py), with plain items for children:
a lone client takes every item, a freed item goes to the waiting client that holds the fewest,
a client whose spec timed out holds one at a time for a while, and nobody waits past the bound
or queues without end."""
from __future__ import annotations

import asyncio

import pytest

from gateway.grammar.compile_queue import CompilerBusy, FairQueue


def run(coro):
    return asyncio.run(coro)


async def _started(*aws):
    tasks = [asyncio.ensure_future(a) for a in aws]
    await asyncio.sleep(0.01)
    return tasks


def test_a_lone_client_takes_every_item():
    async def main():
        q = FairQueue(["c1", "c2", "c3"], wait_s=1.0)
        got = [await q.acquire("A") for _ in range(3)]
        return sorted(got), q.held("A")

    assert run(main()) == (["c1", "c2", "c3"], 3)


def test_a_freed_item_goes_to_the_client_holding_the_fewest_not_to_the_longest_queue():
    async def main():
        q = FairQueue(["c1", "c2"], wait_s=5.0)
        a1, a2 = await q.acquire("A"), await q.acquire("A")
        flood = await _started(*(q.acquire("A") for _ in range(5)))  # A's queue: five before B
        (b,) = await _started(q.acquire("B"))
        q.release("A", a1)
        await asyncio.sleep(0.01)
        first = (b.done(), b.result(), [t.done() for t in flood])
        q.release("A", a2)  # now A holds 0 and B 1: A's oldest waiter
        await asyncio.sleep(0.01)
        second = [t.done() for t in flood]
        for t in flood:
            t.cancel()
        return first, second

    first, second = run(main())
    assert first == (True, "c1", [False] * 5)
    assert second == [True, False, False, False, False]


def test_between_clients_holding_as_many_the_longest_waiting_goes_first():
    async def main():
        q = FairQueue(["c1"], wait_s=5.0)
        held = await q.acquire("A")
        (c,) = await _started(q.acquire("C"))
        (b,) = await _started(q.acquire("B"))
        q.release("A", held)
        await asyncio.sleep(0.01)
        done = (c.done(), b.done())
        q.release("C", c.result())
        await asyncio.sleep(0.01)
        return done, b.done()

    assert run(main()) == ((True, False), True)


def test_a_client_whose_spec_timed_out_holds_one_item_at_a_time_for_a_while():
    async def main():
        q = FairQueue(["c1", "c2", "c3"], wait_s=5.0, slow_cooldown_s=0.3)
        item = await q.acquire("A")
        q.cap("A")  # its compile timed out: the child restarts, still held by A
        (second,) = await _started(q.acquire("A"))
        capped = (second.done(), q.held("A"))
        q.release("A", item)  # restarted
        await asyncio.sleep(0.01)
        mine = second.result()
        (third,) = await _started(q.acquire("A"))
        still = third.done()
        await asyncio.sleep(0.4)  # the cap ends: the waiter takes a free item without a release
        return capped, still, third.done(), q.held("A"), mine != third.result()

    assert run(main()) == ((False, 1), False, True, 2, True)


def test_between_clients_holding_as_many_one_whose_specs_time_out_goes_last():
    async def main():
        q = FairQueue(["c1"], wait_s=5.0)
        held = await q.acquire("A")
        (a,) = await _started(q.acquire("A"))  # A's waiter is older than B's
        (b,) = await _started(q.acquire("B"))
        q.cap("A")
        q.release("A", held)  # restarted: A and B hold none, and B goes first
        await asyncio.sleep(0.01)
        first = (b.done(), a.done())
        q.release("B", b.result())
        await asyncio.sleep(0.01)
        return first, a.done()

    assert run(main()) == ((True, False), True)


def test_past_the_wait_bound_the_request_is_refused_and_its_place_given_up():
    async def main():
        q = FairQueue(["c1"], wait_s=0.2)
        held = await q.acquire("A")
        with pytest.raises(CompilerBusy) as e:
            await q.acquire("B")
        refused = (str(e.value), q.waiting("B"))
        q.release("A", held)  # nobody waits: it stays free for the next
        return refused, await asyncio.wait_for(q.acquire("C"), 0.1)

    (message, waiting), next_item = run(main())
    assert message == ("no grammar compiler was free within 0.2 s (--max-grammar-queue-seconds): "
                       "the structured-output specs of other requests hold them; retry later")
    assert (waiting, next_item) == (0, "c1")


def test_one_client_queues_only_so_many_specs():
    async def main():
        q = FairQueue(["c1"], wait_s=5.0, max_waiting=2)
        await q.acquire("A")
        waiters = await _started(q.acquire("A"), q.acquire("A"))
        with pytest.raises(CompilerBusy) as e:
            await q.acquire("A")
        other = await _started(q.acquire("B"))  # another client still queues
        for t in waiters + other:
            t.cancel()
        return str(e.value), q.waiting("B")

    assert run(main()) == ("2 structured-output specs of this client already wait for a grammar "
                           "compiler; retry later", 1)


def test_an_asker_that_goes_leaves_no_waiter_and_no_item_behind():
    async def main():
        q = FairQueue(["c1"], wait_s=5.0)
        held = await q.acquire("A")
        (b,) = await _started(q.acquire("B"))
        b.cancel()
        await asyncio.sleep(0.01)
        q.release("A", held)
        return q.waiting("B"), await asyncio.wait_for(q.acquire("C"), 0.1), q._clients.keys() == {"C"}

    assert run(main()) == (0, "c1", True)


def test_a_warm_item_goes_out_before_a_cold_one():
    """A compiler child not started yet takes seconds: a spec gets a started one if any is free."""
    async def main():
        q = FairQueue(["cold", "warm"], wait_s=1.0, warm=lambda item: item == "warm")
        first = await q.acquire("A")
        return first, await q.acquire("A")

    assert run(main()) == ("warm", "cold")
