"""A stand-in for any pagoda process under the launcher (`--scheduler-module
tests.stand_in_serving`, ...): it serves nothing and runs until SIGTERM. It ignores its flags.
With PAGODA_STAND_IN_LOG set it appends "serving PID" at start and "stopped PID" at SIGTERM."""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable


def note(what: str) -> None:
    if path := os.environ.get("PAGODA_STAND_IN_LOG"):
        with open(path, "a") as f:
            f.write(f"{what} {os.getpid()} {time.time():.3f}\n")


def until_sigterm(ready: Callable[[], None], poll_s: float = 0.05) -> None:
    """Catches SIGTERM, calls ready() (so that whoever waits for it may signal from then on) and
    returns once SIGTERM came."""
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    ready()
    while not stop:
        time.sleep(poll_s)


def main() -> int:
    until_sigterm(lambda: note("serving"))
    note("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
