"""What GetLoads reports: each worker's queues, its KV pool, its prefix-cache hit rate and what
its speculative proposals came to."""
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
        spec = sched.speculation
        out.workers.add(
            worker_id=state.hello.worker_id, running=running, waiting=sched.num_waiting,
            swapped=len(sched.swapped), kv_blocks_used=kv.num_used, kv_blocks_total=kv.num_blocks,
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
            spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_num_accepted_tokens_per_pos=spec.accepted_per_position,
            spec_acceptance_rate=spec.acceptance_rate,
            spec_mean_acceptance_length=spec.mean_acceptance_length)
    return out
