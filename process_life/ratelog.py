"""A log line that a flood cannot multiply: no process's loop may spend a burst of bad or
unanswerable messages on one warning each (a gateway sending 200,000 adds once cost the
scheduler 177,495 lines). Shared by the scheduler and the gateway; standard library only."""
from __future__ import annotations

import logging
import math
import time


class RateLimitedLog:
    """At most one warning per `interval` seconds; the ones in between are counted, and the count
    goes with the next line."""

    def __init__(self, log: logging.Logger, interval: float = 1.0) -> None:
        self.log, self.interval = log, interval
        self.total = 0   # in all, for tests
        self._quiet = 0  # since the last line
        self._last = -math.inf

    def warning(self, fmt: str, *args) -> None:
        self.total += 1
        now = time.monotonic()
        if now - self._last < self.interval:
            self._quiet += 1
            return
        if self._quiet:
            fmt += f" (and {self._quiet} more such since the last line)"
        self.log.warning(fmt, *args)
        self._last, self._quiet = now, 0
