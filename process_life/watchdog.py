"""A watchdog on a process's own loop: the loop calls tick() each turn, and a daemon thread exits
the process (code EXIT_CODE) with the main thread's stack on stderr once the loop has not turned
for --watchdog-timeout seconds, so that the launcher, compose or Kubernetes starts it again.

A heartbeat from a side thread would go on beating while the loop is wedged; this one stops with
it. The check still runs when the loop is stuck in Python code (the GIL switches threads), not
when it is stuck in C code that holds the GIL. It is armed by the first tick, so that loading a
model or a tokenizer before the loop starts never counts as a hang. Standard library only: the
scheduler imports it.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback

from process_life.flag_types import SECONDS
from process_life.lifetime import write_stderr as _write

EXIT_CODE = 70  # EX_SOFTWARE: tells a hang from a crash in the launcher's log
WORKER_TIMEOUT_S = 30.0  # one forward runs inside one turn of the worker's loop
LOOP_TIMEOUT_S = 10.0    # the scheduler's and the gateway's loops turn at least every 0.5 s

_last_tick: float | None = None  # monotonic; None until the loop first turns


def tick() -> None:
    """Called by the loop once per turn: one assignment, cheap enough for every turn."""
    global _last_tick
    _last_tick = time.monotonic()


def stalled_for() -> float:
    """Seconds since the last tick; 0 before the first."""
    last = _last_tick
    return 0.0 if last is None else time.monotonic() - last


async def tick_forever(interval_s: float = 0.5) -> None:
    """For an asyncio loop: a task that ticks while the loop runs callbacks at all."""
    import asyncio
    while True:
        tick()
        await asyncio.sleep(interval_s)


def add_flag(parser: argparse.ArgumentParser, default_s: float) -> argparse.ArgumentParser:
    # default None, resolved by start(): the launcher hands the flag to every process, and one
    # value given there must mean the same in each (tests/unit/launch/test_launch.py), whatever the default.
    parser.add_argument("--watchdog-timeout", type=SECONDS, default=None, metavar="S",
                        help=f"exit with code {EXIT_CODE} and the main thread's stack when this "
                             f"process's loop has not turned for S seconds, so that its "
                             f"supervisor restarts it; 0 = off (default: %(default)s, that is "
                             f"{default_s:g} for this process)")
    return parser


def start(timeout_s: float | None, default_s: float) -> threading.Thread | None:
    """Starts the checking thread (none when the timeout is 0). timeout_s: the flag's value."""
    timeout_s = default_s if timeout_s is None else timeout_s
    if timeout_s <= 0:
        return None
    thread = threading.Thread(target=_watch, args=(timeout_s,), name="watchdog", daemon=True)
    thread.start()
    return thread


def _watch(timeout_s: float) -> None:
    while True:
        time.sleep(min(1.0, timeout_s / 4))
        stalled = stalled_for()
        if stalled > timeout_s:
            _die(stalled, timeout_s)


def _die(stalled: float, timeout_s: float) -> None:
    frame = sys._current_frames().get(threading.main_thread().ident)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no main thread)\n"
    # Straight to fd 2, not through logging: the wedged thread may hold a handler's lock.
    _write(f"CRITICAL watchdog: the main loop of pid {os.getpid()} has not turned for "
           f"{stalled:.1f} s (--watchdog-timeout {timeout_s:g}); exiting with code {EXIT_CODE}. "
           f"The main thread's stack, most recent call last:\n{stack}")
    os._exit(EXIT_CODE)


