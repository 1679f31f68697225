"""What GetLoads reports: each worker's queues, its KV pool and its prefix-cache hit rate."""
from __future__ import annotations

from typing import Iterable

from proto import pagoda_pb2
from scheduler.request import Status


def loads_of(pending, workers: Iterable) -> pagoda_pb2.GetLoadsResponse:
    """pending: the router's unrouted sequences; workers: its WorkerStates."""
    out = pagoda_pb2.GetLoadsResponse(num_pending=len(pending))
    for state in workers:
        sched, kv = state.scheduler, state.scheduler.kv
        running = sum(r.status is Status.RUNNING for r in sched.requests.values())
        queries, hits = kv.prefix_stats()
        out.workers.add(
            worker_id=state.hello.worker_id, running=running, waiting=sched.num_waiting,
            swapped=len(sched.swapped), kv_blocks_used=kv.num_used, kv_blocks_total=kv.num_blocks,
            prefix_cache_hit_rate=hits / queries if queries else 0.0)
    return out
