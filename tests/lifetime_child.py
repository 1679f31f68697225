"""Processes for tests/unit/launch/test_lifetime.py, each `python -m tests.lifetime_child MODE [ARG]`.

    child DRAIN      process_life/lifetime.py with that drain; on SIGTERM its "drain" wedges the main
                     thread in Python code for good (prints "ready", then "draining")
    parent           spawns `child 60` as the launcher spawns its processes (launch.children.spawn),
                     prints the child's pid, then sleeps
    witness          a subreaper: starts `parent`, SIGKILLs it once the child is ready, and prints
                     "EXIT_CODE SECONDS": how the orphaned child ended, and how long after
    wedge TIMEOUT    process_life/watchdog.py with that timeout: a few ticks, then wedged_turn() spins
                     (prints "wedging" first)
    healthy TIMEOUT  the same watchdog: 2 s before the first tick, then 2 s of ticks; exits 0
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from tests.stand_in_serving import until_sigterm

PR_SET_CHILD_SUBREAPER = 36


def say(text: str) -> None:
    print(text, flush=True)


def child(drain_s: float) -> None:
    from process_life import lifetime
    lifetime.start(drain_s)
    until_sigterm(lambda: say("ready"), poll_s=0.02)
    say("draining")
    while True:  # a drain that never ends, in Python code
        pass


def parent() -> None:
    from launch.children import spawn
    proc = spawn([sys.executable, "-m", "tests.lifetime_child", "child", "60"], dict(os.environ))
    say(str(proc.pid))
    time.sleep(600)


def witness() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    parent_proc = subprocess.Popen([sys.executable, "-m", "tests.lifetime_child", "parent"],
                                   stdout=subprocess.PIPE, text=True)
    child_pid = int(parent_proc.stdout.readline())
    assert parent_proc.stdout.readline().strip() == "ready"  # the child shares the pipe
    parent_proc.kill()
    parent_proc.wait()
    killed = time.monotonic()
    while time.monotonic() - killed < 30:
        pid, status = os.waitpid(child_pid, os.WNOHANG)  # it is this process's child now
        if pid:
            say(f"{os.waitstatus_to_exitcode(status)} {time.monotonic() - killed:.2f}")
            return
        time.sleep(0.02)
    os.kill(child_pid, signal.SIGKILL)
    say("alive 30")


def wedged_turn() -> None:
    while True:
        pass


def wedge(timeout_s: float) -> None:
    from process_life import watchdog
    watchdog.start(timeout_s, default_s=0)
    for _ in range(5):
        watchdog.tick()
        time.sleep(0.05)
    say("wedging")
    wedged_turn()


def healthy(timeout_s: float) -> None:
    from process_life import watchdog
    watchdog.start(timeout_s, default_s=0)
    time.sleep(2 * timeout_s)  # loading: the watchdog is armed by the first tick only
    ends = time.monotonic() + 2 * timeout_s
    while time.monotonic() < ends:
        watchdog.tick()
        time.sleep(0.05)
    say("done")


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    {"child": lambda: child(float(rest[0])), "parent": parent, "witness": witness,
     "wedge": lambda: wedge(float(rest[0])), "healthy": lambda: healthy(float(rest[0]))}[mode]()
