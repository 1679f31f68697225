"""What the router (scheduler/router.py) and each worker's scheduler (scheduler/scheduler.py) are
configured with. Their own module, so that the parts below them can name the settings without
importing the classes that use them."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    eos_token_ids: frozenset[int] = frozenset()
    num_cpu_blocks: int = 0            # swap space; 0 = recompute only
    bytes_per_block: int = 0
    swap_bytes_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    max_plans_in_flight: int = 2       # 2 = one plan ahead; 1 = wait for each result
    # Speculative decoding: proposals a decode row may verify per step (the worker's hello says;
    # 0 = off). It plans one step at a time: the next plan needs to know how many were accepted.
    num_speculative_tokens: int = 0
    spec_disable_by_batch_size: int = 0  # no proposals with more running sequences (0: never)
    spec_paced_by_worker: bool = False   # the proposer sizes its drafts: no back-off here


@dataclass
class RouterConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 1024
    max_plans_in_flight: int = 2
    max_step_failures: int = 2  # lost steps that end a sequence (scheduler/lost_steps.py)
    max_seqs_per_tenant: int = 0  # scheduler/tenants.py
    # A prefix hit wins the routing unless its worker is this much busier than the least loaded.
    load_slack: int = 8
