"""Prometheus metrics, read from the router's state when scraped, so the step loop pays nothing."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from scheduler.request import Status
from scheduler.router import Router


class RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        g = {name: GaugeMetricFamily(f"pagoda_{name}", doc, labels=["worker"]) for name, doc in [
            ("kv_cache_usage_ratio", "KV blocks in use over all KV blocks"),
            ("kv_cache_token_utilization", "tokens held over the slots of allocated blocks"),
            ("kv_blocks_total", "KV blocks in the pool"),
            ("kv_blocks_free", "KV blocks on the free list (cached prefixes included)"),
            ("num_requests_running", "sequences in the running batch"),
            ("num_requests_waiting", "sequences waiting for blocks"),
            ("num_requests_swapped", "sequences swapped out to CPU"),
        ]}
        preempt = CounterMetricFamily("pagoda_num_preemptions", "preemptions by mode",
                                      labels=["worker", "mode"])
        queries = CounterMetricFamily("pagoda_prefix_cache_queries",
                                      "prompt tokens looked up in the prefix cache", labels=["worker"])
        hits = CounterMetricFamily("pagoda_prefix_cache_hits",
                                   "prompt tokens found in the prefix cache", labels=["worker"])
        steps = CounterMetricFamily("pagoda_worker_steps", "steps the worker executed",
                                    labels=["worker"])
        forward = CounterMetricFamily("pagoda_worker_forward_seconds",
                                      "the worker's time executing steps", labels=["worker"])
        spec = {name: CounterMetricFamily(f"pagoda_spec_decode_{name}", doc, labels=["worker"])
                for name, doc in [
                    ("num_drafts", "speculative drafts: one sequence's proposals in one step"),
                    ("num_draft_tokens", "tokens proposed"),
                    ("num_accepted_tokens", "proposed tokens the target model accepted")]}
        per_pos = CounterMetricFamily("pagoda_spec_decode_num_accepted_tokens_per_pos",
                                      "accepted proposals by their position in the draft",
                                      labels=["worker", "position"])
        for state in list(self.router.workers.values()):
            wid = state.hello.worker_id
            sched, kv = state.scheduler, state.scheduler.kv
            used = kv.num_used
            reqs = list(sched.requests.values())
            running = [r for r in reqs if r.status is Status.RUNNING]
            bs = kv.block_size
            slots = used * bs
            empty = sum(len(r.block_ids) * bs - r.num_computed_tokens for r in running)
            g["kv_cache_usage_ratio"].add_metric([wid], used / max(1, kv.num_blocks))
            g["kv_cache_token_utilization"].add_metric([wid], (slots - empty) / slots if slots else 0.0)
            g["kv_blocks_total"].add_metric([wid], kv.num_blocks)
            g["kv_blocks_free"].add_metric([wid], kv.num_free)
            g["num_requests_running"].add_metric([wid], len(running))
            g["num_requests_waiting"].add_metric([wid], sched.num_waiting)
            g["num_requests_swapped"].add_metric([wid], sum(r.status is Status.SWAPPED for r in reqs))
            for mode, count in sched.stats.num_preemptions.items():
                preempt.add_metric([wid, mode], count)
            num_queries, num_hits = kv.prefix_stats()
            queries.add_metric([wid], num_queries)
            hits.add_metric([wid], num_hits)
            steps.add_metric([wid], state.steps)
            forward.add_metric([wid], state.forward_seconds)
            stats = sched.speculation
            spec["num_drafts"].add_metric([wid], stats.num_drafts)
            spec["num_draft_tokens"].add_metric([wid], stats.num_draft_tokens)
            spec["num_accepted_tokens"].add_metric([wid], stats.num_accepted_tokens)
            for pos, count in enumerate(stats.accepted_per_position):
                per_pos.add_metric([wid, str(pos)], count)
        yield from g.values()
        yield from (preempt, queries, hits, steps, forward)
        yield from spec.values()
        yield per_pos
