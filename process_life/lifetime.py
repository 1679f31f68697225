"""A bound on how long a process outlives a stop, enforced by a daemon thread, whatever its loop
is doing.

Once a process got SIGTERM or SIGINT it has its drain (a gateway's grace period, a worker's step
in hand) plus MARGIN_S to exit; past that the thread calls os._exit(EXIT_CODE). Once the launcher
that started it is gone (the launcher sets PARENT_ENV to its pid; getppid() then differs), the
drain is cut to ORPHAN_DRAIN_S: nobody supervises an orphan, and one that drained for its whole
grace period, or forever with a wedged loop, would hold its ports against the next `make run`.
PR_SET_PDEATHSIG, which start() sets when a launcher started this process, sends the orphan
SIGTERM; this thread sends one itself when that did not happen (the launcher died before prctl
ran), so it drains as it would on a stop. The child sets it, not the launcher in a preexec_fn:
that makes subprocess fork() rather than vfork() the launcher, whose gRPC fork handlers restart
their pollers in the child, and those abort once the child closes its inherited descriptors.

The thread learns of a signal through signal.set_wakeup_fd, which Python writes from its C
handler: it needs no cooperation from the loop, as long as the process handles the signal in
Python (the scheduler and the worker do). An asyncio loop takes the wakeup fd for itself, so the
gateway passes watch_signals=False and calls stopping() from its own signal handler. The check
runs while the main thread is stuck in Python code (the GIL switches threads), not while it is
stuck in C code that holds the GIL. Standard library only: the scheduler imports it.
"""
from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass

PARENT_ENV = "PAGODA_PARENT_PID"
EXIT_CODE = 124     # as timeout(1): the process outstayed its bound
MARGIN_S = 3.0      # past the drain: closing sockets, flushing logs
ORPHAN_DRAIN_S = 2.0
CHECK_S = 0.25
PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class Deadline:
    at: float       # monotonic
    bound_s: float
    why: str


@dataclass
class Lifetime:
    drain_s: float                 # what a stop may take before MARGIN_S
    parent_pid: int | None = None  # the launcher's, when one started this process
    deadline: Deadline | None = None
    stop_seen: bool = False
    orphan_seen: bool = False

    def orphaned(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def drain(self, requested_s: float) -> float:
        """The drain to allow now: cut short once the launcher is gone."""
        return min(requested_s, ORPHAN_DRAIN_S) if self.orphaned() else requested_s

    def stopping(self, why: str = "a stop") -> None:
        """The process begins to stop: arms the deadline (an earlier one stays)."""
        self.stop_seen = True
        self.arm(self.drain(self.drain_s) + MARGIN_S, why)

    def arm(self, bound_s: float, why: str) -> None:
        # One attribute assignment, atomic under the GIL: the loop and the thread both call this.
        at = time.monotonic() + bound_s
        if self.deadline is None or at < self.deadline.at:
            self.deadline = Deadline(at, bound_s, why)


_life: Lifetime | None = None


def start(drain_s: float, watch_signals: bool = True) -> Lifetime:
    """Once, early in main(), in the main thread. drain_s: what this process's stop may take."""
    global _life
    parent = os.environ.pop(PARENT_ENV, "")  # popped: a grandchild's parent is not the launcher
    _life = Lifetime(drain_s, int(parent) if parent.isdigit() else None)
    if _life.parent_pid is not None:
        die_with_parent(signal.SIGTERM)
    wakeup = _wakeup_pipe() if watch_signals else None
    threading.Thread(target=_watch, args=(_life, wakeup), name="lifetime", daemon=True).start()
    return _life


def die_with_parent(signum: int) -> None:
    """PR_SET_PDEATHSIG: signum when the parent dies. Check getppid() afterwards: a parent that
    died before this call sent nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum))
    except (OSError, AttributeError):
        pass


def stopping(why: str = "a stop") -> None:
    if _life is not None:
        _life.stopping(why)


def drain(requested_s: float) -> float:
    return _life.drain(requested_s) if _life is not None else requested_s


def _wakeup_pipe() -> int | None:
    if threading.current_thread() is not threading.main_thread():
        return None
    r, w = os.pipe()
    os.set_blocking(w, False)  # Python writes it from a signal handler
    old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    if old != -1:  # someone else's: leave it theirs
        signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        return None
    return r


def _watch(life: Lifetime, wakeup: int | None) -> None:
    while True:
        received = b""
        if wakeup is None:
            time.sleep(CHECK_S)
        elif select.select([wakeup], [], [], CHECK_S)[0]:
            received = os.read(wakeup, 512)
        for signum in set(received) & set(STOP_SIGNALS):
            life.stopping(signal.Signals(signum).name)
        if not life.orphan_seen and life.orphaned():
            life.orphan_seen = True
            life.arm(ORPHAN_DRAIN_S + MARGIN_S,
                     f"the launcher's death (pid {life.parent_pid})")
            write_stderr(f"pid {os.getpid()}: the launcher (pid {life.parent_pid}) is gone: exiting "
                   f"within {ORPHAN_DRAIN_S + MARGIN_S:g} s\n")
            if not life.stop_seen:
                os.kill(os.getpid(), signal.SIGTERM)
        deadline = life.deadline
        if deadline is not None and time.monotonic() > deadline.at:
            write_stderr(f"CRITICAL pid {os.getpid()}: still running {deadline.bound_s:g} s after "
                   f"{deadline.why}; exiting with code {EXIT_CODE}\n")
            os._exit(EXIT_CODE)


def write_stderr(text: str) -> None:
    # Straight to fd 2, not through logging: a wedged main thread may hold a handler's lock.
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass


def exit_now(code: int) -> None:
    """Exits with code once a process has closed what it owns (sockets, children, files): logs
    and stdio are flushed, and the interpreter's own teardown is skipped. In a process that
    imported torch that teardown is 0.3-0.5 s of CPU (module and thread finalization) that would
    only delay a stop: the launcher waits for each child in turn."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
