"""The gateway's grammar-compiler child, started the way the gateway runs (on uvloop), with a
stand-in child that speaks the same line protocol (the real one is exercised by the structured
integration tests): it is started without fork(), answers, and a child that dies or stalls is
reported and replaced; a slow spec holds one child of several, a client alone all of them, and
another client's spec waits for one compile, not for a flood (the fair queue's own tests:
test_gateway_compile_queue.py)."""
from __future__ import annotations

import asyncio
import os
import sys
import time

import uvloop

from gateway.grammar.grammar_check import TOO_SLOW, CompilerBusy, GrammarChecker
from structured.spec import Spec

# Ready once told its vocabulary (the first line); answers every spec; "slow" as the real child
# does one past its bound (timed out, after the bound), "hang" never (a wedged child), "die" by
# exiting; "told" is answered with the vocabulary and its pid; "count..." and "late..." (after
# 0.5 s) with how many times this child compiled them.
STAND_IN = """
import json, os, sys, time
told = json.loads(sys.stdin.readline())
seen = {}
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    msg = json.loads(line)
    if msg["value"] == "die":
        sys.exit(3)
    if msg["value"] == "hang":
        time.sleep(60)
    if msg["value"] == "slow":
        time.sleep(told["timeout_s"])
        print(json.dumps({"id": msg["id"], "error": None, "timed_out": True}), flush=True)
        continue
    if msg["value"].startswith("late"):
        time.sleep(0.5)
    seen[msg["value"]] = seen.get(msg["value"], 0) + 1
    error = {"bad": "bad", "told": f"{told} {os.getpid()}"}.get(msg["value"], msg["value"])
    if msg["value"].startswith(("count", "late")):
        error = f"{msg['value']} {seen[msg['value']]}"
    elif msg["value"] not in ("bad", "told"):
        error = None
    print(json.dumps({"id": msg["id"], "error": error}), flush=True)
"""


def checker(program: str, timeout_s: float = 5.0, vocabulary=lambda: (0, []), processes: int = 2) -> GrammarChecker:
    return GrammarChecker(tokenizer_json=None, vocabulary=vocabulary, timeout_s=timeout_s,
                          processes=processes, args=[sys.executable, "-c", program])


def test_a_child_spawned_early_is_told_the_vocabulary_when_warmed():
    """The gateway spawns the child at its start, before any worker has said the vocabulary's
    size, so that its imports overlap the workers' load: that same child is used, told the size
    known when it is warmed."""
    vocabulary = [(0, [])]

    async def main():
        c = checker(STAND_IN, vocabulary=lambda: vocabulary[-1])
        try:
            await c.spawn()
            spawned = c._children[0].proc.pid
            vocabulary.append((49152, [2, 7]))
            await c.warm()
            return spawned, await c.check(Spec("regex", "told"))
        finally:
            await c.close()

    spawned, told = uvloop.run(main())
    assert told == f"{{'vocab_size': 49152, 'eos_token_ids': [2, 7], 'timeout_s': 5.0}} {spawned}"


def test_warming_while_the_spawn_is_under_way_waits_for_it():
    """The gateway's start spawns the children in a task, and a worker's ClusterInfo, already
    there when the gateway connects, warms them in another: the warm waited for nothing, found a
    process without its pipes yet, and failed, so readiness came without the children."""
    async def main():
        c = checker(STAND_IN, vocabulary=lambda: (49152, [2]))
        try:
            spawning = asyncio.ensure_future(c.spawn())
            await asyncio.sleep(0)  # the spawn task is inside its first await, as in the gateway
            await asyncio.gather(spawning, c.warm())
            return [child._ready for child in c._children], await c.check(Spec("regex", "told"))
        finally:
            await c.close()

    ready, told = uvloop.run(main())
    assert ready == [True, True] and told.startswith("{'vocab_size': 49152, 'eos_token_ids': [2], ")


def test_the_compiler_child_starts_without_forking_the_gateway():
    # uvloop's subprocess_exec fork()s, and in the gRPC-running gateway gRPC's fork handlers can
    # abort the child before exec (CI: "did not say ready"). Python's fork handlers stand witness.
    forks: list[int] = []
    os.register_at_fork(before=lambda: forks.append(1))

    async def main():
        c = checker(STAND_IN)
        try:
            return [await c.check(Spec("regex", "a+")), await c.check(Spec("regex", "bad"))]
        finally:
            await c.close()

    assert uvloop.run(main()) == [None, "bad"]
    assert forks == []


def test_a_child_that_dies_is_reported_and_replaced():
    async def main():
        c = checker(STAND_IN)
        try:
            died = await c.check(Spec("regex", "die"))
            return died, await c.check(Spec("regex", "a+"))
        finally:
            await c.close()

    assert uvloop.run(main()) == ("the grammar compiler failed on it", None)


def test_a_slow_spec_times_out_in_the_child_which_goes_on_answering():
    async def main():
        c = checker(STAND_IN, timeout_s=0.5, processes=1)
        try:
            slow = await c.check(Spec("regex", "slow"))
            pid = c._children[0].proc.pid
            return slow, await c.check(Spec("regex", "told")), pid
        finally:
            await c.close()

    slow, told, pid = uvloop.run(main())
    assert slow == f"{TOO_SLOW} 0.5 s (--max-grammar-compile-seconds)"
    assert told.endswith(f" {pid}")  # the same child: a timeout costs no restart


def test_a_child_that_does_not_answer_is_killed_past_the_backstop_and_replaced():
    async def main():
        c = checker(STAND_IN, timeout_s=0.5, processes=1)
        try:
            await c.warm()
            pid = c._children[0].proc.pid
            started = time.monotonic()
            hung = await c.check(Spec("regex", "hang"))
            took = time.monotonic() - started
            return hung, took, await c.check(Spec("regex", "told")), pid
        finally:
            await c.close()

    hung, took, told, pid = uvloop.run(main())
    assert hung == f"{TOO_SLOW} 0.5 s (--max-grammar-compile-seconds)" and 2.4 < took < 3.5
    assert not told.endswith(f" {pid}")  # a fresh child


def test_a_child_that_never_says_ready_is_an_error_naming_its_exit():
    async def main():
        c = checker("import sys; sys.exit(5)")
        try:
            await c.check(Spec("regex", "a+"))
        except RuntimeError as e:
            return str(e)
        finally:
            await c.close()

    assert uvloop.run(main()) == "the grammar compiler did not start: it did not say ready (exit status 5)"


async def _first_done(*aws):
    tasks = [asyncio.ensure_future(a) for a in aws]
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    return tasks, done


def test_a_slow_spec_holds_one_child_and_another_spec_is_answered_meanwhile():
    """One client's pathological pattern costs other requests nothing: theirs compile in another
    child while it runs to the limit (with one child they waited for the limit and a restart)."""
    async def main():
        c = checker(STAND_IN, timeout_s=3.0)
        try:
            (slow, quick), done = await _first_done(c.check(Spec("regex", "slow")), c.check(Spec("regex", "a+")))
            first = (quick in done, slow in done, quick.result())
            # The slow one's child is started again in the background: the next spec does not wait.
            return first, await slow, await c.check(Spec("regex", "b+"))
        finally:
            await c.close()

    first, slow, after = uvloop.run(main())
    assert first == (True, False, None)
    assert (slow, after) == (f"{TOO_SLOW} 3 s (--max-grammar-compile-seconds)", None)


def test_a_lone_client_compiles_in_every_child():
    async def main():
        c = checker(STAND_IN)
        try:
            await c.warm()
            started = time.monotonic()
            answers = await asyncio.gather(c.check(Spec("regex", "late"), "A"),
                                           c.check(Spec("grammar", "late"), "A"))
            return answers, time.monotonic() - started
        finally:
            await c.close()

    answers, took = uvloop.run(main())
    assert answers == ["late 1", "late 1"] and took < 0.9  # side by side: 0.5 s, not 1 s


def test_another_clients_spec_waits_for_one_slow_compile_not_for_the_flood():
    """Client A floods slow specs, which take both children first (nobody else asked): B's spec
    then waits for one of them to time out, not for A's queue; and A, whose specs timed out,
    holds one child at a time afterwards, so that B's next spec is compiled at once."""
    async def main():
        c = checker(STAND_IN, timeout_s=1.0)
        try:
            await c.warm()
            flood = [asyncio.ensure_future(c.check(Spec("regex", "slow", (str(i),)), "A"))
                     for i in range(6)]
            await asyncio.sleep(0.2)
            started = time.monotonic()
            first = await c.check(Spec("regex", "c+"), "B")
            first_took = time.monotonic() - started
            # Both of A's first specs time out 1 s after they started, which under load may be
            # apart by more than B's answer takes: count once both have.
            until = time.monotonic() + 1.0
            while sum(f.done() for f in flood) < 2 and time.monotonic() < until:
                await asyncio.sleep(0.01)
            waiting = sum(not f.done() for f in flood)
            started = time.monotonic()
            second = await c.check(Spec("regex", "d+"), "B")
            for f in flood:
                f.cancel()
            return first, first_took, waiting, second, time.monotonic() - started, c.queue.held("A")
        finally:
            await c.close()

    first, first_took, waiting, second, second_took, held = uvloop.run(main())
    assert (first, second, held, waiting) == (None, None, 1, 4)
    assert first_took < 1.6 and second_took < 0.3


def test_past_the_wait_bound_a_spec_is_refused_as_busy():
    async def main():
        c = checker(STAND_IN, timeout_s=3.0, processes=1)
        c.queue.wait_s = 0.5
        try:
            await c.warm()
            slow = asyncio.ensure_future(c.check(Spec("regex", "slow"), "A"))
            await asyncio.sleep(0.1)
            started = time.monotonic()
            try:
                await c.check(Spec("regex", "c+"), "B")
            except CompilerBusy as e:
                refused = str(e), time.monotonic() - started
            slow.cancel()
            return refused
        finally:
            await c.close()

    message, took = uvloop.run(main())
    assert message.startswith("no grammar compiler was free within 0.5 s (--max-grammar-queue-seconds)")
    assert 0.45 < took < 1.0


def test_the_same_spec_asked_at_once_is_compiled_once():
    async def main():
        c = checker(STAND_IN)
        try:
            return await asyncio.gather(*(c.check(Spec("regex", "count")) for _ in range(3)))
        finally:
            await c.close()

    assert uvloop.run(main()) == ["count 1"] * 3


def test_an_asker_that_hangs_up_leaves_no_answer_for_the_next_spec():
    """A client that hangs up while its spec compiles (HTTP aborts it): the answer still comes
    for that spec, and the child's next spec gets its own answer, not the late one."""
    async def main():
        c = checker(STAND_IN, processes=1)
        try:
            asker = asyncio.ensure_future(c.check(Spec("regex", "late")))
            await asyncio.sleep(0.2)
            asker.cancel()
            return await c.check(Spec("regex", "count")), await c.check(Spec("regex", "late"))
        finally:
            await c.close()

    assert uvloop.run(main()) == ("count 1", "late 1")  # the second "late" is the cached answer
