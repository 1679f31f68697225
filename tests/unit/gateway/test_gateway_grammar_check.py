"""The gateway's grammar-compiler child, started the way the gateway runs (on uvloop), with a
stand-in child that speaks the same line protocol (the real one is exercised by the structured
integration tests): it is started without fork(), answers, and a child that dies or stalls is
reported and replaced."""
from __future__ import annotations

import os
import sys

import uvloop

from gateway.grammar_check import TOO_SLOW, GrammarChecker
from structured.spec import Spec

# Ready once told its vocabulary (the first line); answers every spec but the regex "slow" (never
# answered) and "die" (the child exits); "told" is answered with the vocabulary and its pid.
STAND_IN = """
import json, os, sys, time
told = json.loads(sys.stdin.readline())
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    msg = json.loads(line)
    if msg["value"] == "die":
        sys.exit(3)
    if msg["value"] == "slow":
        time.sleep(60)
    error = {"bad": "bad", "told": f"{told} {os.getpid()}"}.get(msg["value"])
    print(json.dumps({"id": msg["id"], "error": error}), flush=True)
"""


def checker(program: str, timeout_s: float = 5.0, vocabulary=lambda: (0, [])) -> GrammarChecker:
    c = GrammarChecker(tokenizer_json=None, vocabulary=vocabulary, timeout_s=timeout_s)
    c.args = [sys.executable, "-c", program]
    return c


def test_a_child_spawned_early_is_told_the_vocabulary_when_warmed():
    """The gateway spawns the child at its start, before any worker has said the vocabulary's
    size, so that its imports overlap the workers' load: that same child is used, told the size
    known when it is warmed."""
    vocabulary = [(0, [])]

    async def main():
        c = checker(STAND_IN, vocabulary=lambda: vocabulary[-1])
        try:
            await c.spawn()
            spawned = c._proc.pid
            vocabulary.append((49152, [2, 7]))
            await c.warm()
            return spawned, await c.check(Spec("regex", "told"))
        finally:
            await c.close()

    spawned, told = uvloop.run(main())
    assert told == f"{{'vocab_size': 49152, 'eos_token_ids': [2, 7]}} {spawned}"


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


def test_a_slow_spec_times_out_and_the_next_is_answered():
    async def main():
        c = checker(STAND_IN, timeout_s=0.5)
        try:
            return await c.check(Spec("regex", "slow")), await c.check(Spec("regex", "b+"))
        finally:
            await c.close()

    slow, after = uvloop.run(main())
    assert slow == f"{TOO_SLOW} 0.5 s (--max-grammar-compile-seconds)"
    assert after is None


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
