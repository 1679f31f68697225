"""The launcher's restart policy, per process, as a pure function of its deaths: no clock, no
processes, so that a table of lifetimes can test it.

A process that dies is started again after a delay that doubles with each death in a row, from
first_delay_s up to max_delay_s; a death after it had lived healthy_after_s starts the count
afresh. The give_up_after-th death in a row is the last: the launcher gives up on that process
alone (and stops everything only if it was the scheduler or the gateway, launch/children.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 0.25
    max_delay_s: float = 30.0
    # Longer than the longest watchdog timeout (30 s, a worker's): a process that hangs soon
    # after each start is killed before it counts as healthy, so it is a crash loop too.
    healthy_after_s: float = 60.0
    # With the defaults: 9 restarts over about 92 s of delays (0.25 s doubling, 30 s at most)
    # before the launcher gives up. 0 = never give up.
    give_up_after: int = 10


@dataclass(frozen=True)
class Verdict:
    deaths_in_a_row: int    # this one included
    delay_s: float | None   # before the restart; None: give up on the process


def after_death(policy: RestartPolicy, deaths_in_a_row: int, lived_s: float) -> Verdict:
    """deaths_in_a_row: before this death; lived_s: how long the process had run."""
    n = 1 if lived_s >= policy.healthy_after_s else deaths_in_a_row + 1
    if policy.give_up_after and n >= policy.give_up_after:
        return Verdict(n, None)
    return Verdict(n, min(policy.max_delay_s, policy.first_delay_s * 2 ** (n - 1)))
