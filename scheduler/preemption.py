"""How a victim leaves the GPU: recompute or swap, chosen per victim by a cost model."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.scheduler_config import SchedulerConfig
    from scheduler.kv_cache_manager import KVCacheManager
    from scheduler.request import Request

log = logging.getLogger("pagoda.preemption")


@dataclass
class PreemptionStats:
    num_preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})


class PreemptionPolicy:
    def __init__(self, config: "SchedulerConfig", kv: "KVCacheManager") -> None:
        self.config = config
        self.kv = kv
        self.stats = PreemptionStats()

    def choose(self, req: "Request") -> str:
        """Swap when moving the blocks out and back in costs less time than computing the
        tokens again, by the bandwidth and prefill speed the worker measured at start-up."""
        mode, why = "recompute", "no swap space"
        cfg = self.config
        if self.kv.has_swap_space and req.block_ids:
            if not self.kv.can_swap_out(req):
                why = "swap space full"
            elif cfg.swap_bytes_per_s <= 0 or cfg.prefill_tokens_per_s <= 0:
                mode, why = "swap", "no measurements; swap space configured"
            else:
                swap_s = 2 * len(req.block_ids) * cfg.bytes_per_block / cfg.swap_bytes_per_s
                recompute_s = req.num_computed_tokens / cfg.prefill_tokens_per_s
                mode = "swap" if swap_s < recompute_s else "recompute"
                why = f"swap {swap_s * 1e3:.2f} ms vs recompute {recompute_s * 1e3:.2f} ms"
        self.record(mode)
        log.info("preempt %s (%d tokens, %d blocks) by %s: %s", req.seq_id, req.num_tokens,
                 len(req.block_ids), mode, why)
        return mode

    def record(self, mode: str) -> None:
        """A preemption by `mode` ("recompute" or "swap"), for the metrics."""
        self.stats.num_preemptions[mode] += 1
