"""What a sequence group (scheduler/sequence_group.py) and the results (scheduler/results.py) may
use of their worker's scheduler (scheduler/scheduler.py): its parts, and its verbs that are whole
transitions of a group."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from scheduler.kv_cache_manager import KVCacheManager
    from scheduler.preemption import PreemptionPolicy
    from scheduler.queues import Queued, Queues
    from scheduler.request import FinishReason, Request
    from scheduler.scheduler_config import SchedulerConfig
    from scheduler.speculation_stats import SpeculationStats
    from scheduler.step import Step
    from scheduler.stream import Streams


class Batch(Protocol):
    """What a group may use of its worker's scheduler (scheduler/scheduler.py)."""
    config: SchedulerConfig
    kv: KVCacheManager
    queues: Queues
    preemption: PreemptionPolicy
    speculation: SpeculationStats
    streams: Streams

    def add_sequence(self, seq: Request) -> None: ...
    def finish(self, seq: Request, reason: FinishReason) -> None: ...
    def recompute(self, group: Queued, seqs: list[Request]) -> None: ...
    def swap_out(self, group: Queued, seq: Request, step: Step) -> None: ...
    def swap_in(self, group: Queued, seq: Request, n: int, step: Step) -> bool: ...
    def drop_slot(self, seq: Request) -> None: ...
    def preempt_for(self, group: Queued, step: Step) -> bool: ...
    def has_room(self, seats: int, step: Step) -> bool: ...
