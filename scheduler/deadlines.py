"""Each step a worker runs has a deadline: a worker whose forward hangs (a deadlocked kernel, a
stuck collective) keeps heartbeating from its own thread, so only the missing result shows it.

A step is running from the later of its send and the previous result of that worker (with a plan
ahead, the second plan waits in the worker's socket while the first runs). Its deadline is
`--step-timeout` plus what the step can legitimately cost on that worker, from the worker's own
measurements in its hello: SLACK times its tokens at the measured prefill rate, and SLACK times
its swaps at the measured swap rate. A long first prefill on a slow device therefore never trips
it, while a hung step of any size is caught within seconds of what it should have taken.
An overdue worker is dropped exactly as a silent one is (Router.remove: its sequences are
recomputed elsewhere); a late result from it then comes from an unknown worker and is ignored.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.scheduler_config import SchedulerConfig
    from scheduler.router import WorkerState
    from scheduler.step import Step

SLACK = 4.0  # times the measured cost: a busy machine may run a step this much slower


def step_deadline(step: "Step", config: "SchedulerConfig", base: float) -> float:
    """Seconds `step` may run before its worker is declared hung."""
    seconds = base
    if config.prefill_tokens_per_s > 0:
        tokens = sum(n for _, n, _ in step.entries)
        seconds += SLACK * tokens / config.prefill_tokens_per_s
    if config.swap_bytes_per_s > 0:
        moved = (len(step.swap_out) + len(step.swap_in) + len(step.copy)) * config.bytes_per_block
        seconds += SLACK * moved / config.swap_bytes_per_s
    return seconds


def overdue_workers(workers: dict[bytes, "WorkerState"], now: float,
                    base: float) -> list[tuple[bytes, str]]:
    """(worker, why) for each worker whose running step is past its deadline; none if base <= 0."""
    if base <= 0:
        return []
    out = []
    for ident, state in workers.items():
        sched = state.scheduler
        step = sched.running_step
        if step is None:
            continue
        running = now - max(step.sent_at, sched.last_result_at)
        limit = step_deadline(step, sched.config, base)
        if running > limit:
            out.append((ident, f"step {step.step_id} overdue: no result {running:.1f} s after it "
                               f"started, deadline {limit:.1f} s (--step-timeout {base:g})"))
    return out
