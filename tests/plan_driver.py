"""A tiny offline scheduler for worker tests: allocates blocks, builds StepPlans (chunked prefill,
then one decode token per step) and feeds them to a ModelRunner, the way scheduler/ would; and
run_router, the real scheduler/ feeding one ModelRunner in process."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from proto import internal_pb2
from proto.columns import pack, unpack_list


@dataclass
class _Seq:
    slot: int
    token_ids: list[int]
    sampling: internal_pb2.SamplingConfig
    max_new_tokens: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    sent: bool = False
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


def add_running(plan: internal_pb2.StepPlan, slot: int, n: int, new_blocks=()) -> None:
    """Append a sequence the worker already holds to the plan's running columns."""
    plan.running_slots += pack([slot])
    plan.running_num_tokens += pack([n])
    plan.new_block_slots += pack([slot] * len(new_blocks))
    plan.new_block_ids += pack(new_blocks)


def run_router(router, runner, worker_id: bytes = b"w") -> int:
    """Runs a Router's requests to their end on runner, registered as worker_id: every plan the
    router makes is queued, the oldest executed and its result applied, until no plan is left.
    Returns the most KV blocks in use after any plan was made (blocks are taken when a plan is
    made and freed when its result comes)."""
    kv, peak, inbox = router.workers[worker_id].scheduler.kv, 0, []
    while True:
        for _, plan in router.plans():
            inbox.append(plan)
            peak = max(peak, kv.num_used)
        if not inbox:
            return peak
        router.on_result(worker_id, runner.execute(inbox.pop(0)))


class PlanDriver:
    def __init__(self, runner, block_order: list[int] | None = None, token_budget: int | None = None,
                 chunk_size: int | None = None) -> None:
        """block_order: the order blocks are handed out (a permutation tests non-contiguous
        tables); token_budget: tokens per step over all sequences; chunk_size: per sequence."""
        self.runner = runner
        self.block_size = runner.block_size
        self.free = list(block_order if block_order is not None else range(runner.cache.num_blocks))
        self.token_budget = token_budget
        self.chunk_size = chunk_size
        self.step_id = 0
        self.plans: list[internal_pb2.StepPlan] = []
        # The logits each step samples from: the model's last compute_logits call of the step
        # (prompt logprobs, when asked, come before it).
        compute = runner.model.compute_logits

        def capture(hidden):
            self.sampled_logits = compute(hidden)
            return self.sampled_logits
        runner.model.compute_logits = capture
        # A greedy step may take its tokens from the LM head's own max (greedy_tokens) and
        # compute no logits: those it took them from are computed beside it.
        greedy = runner.model.greedy_tokens

        def capture_greedy(hidden):
            tokens = greedy(hidden)
            if tokens is not None:
                self.sampled_logits = compute(hidden)
            return tokens
        runner.model.greedy_tokens = capture_greedy

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 sampling: internal_pb2.SamplingConfig | None = None) -> list[_Seq]:
        sampling = sampling or internal_pb2.SamplingConfig()  # temperature 0: greedy
        seqs = [_Seq(i, list(p), sampling, max_new_tokens) for i, p in enumerate(prompts)]
        dropped: list[int] = []
        while any(not s.done for s in seqs):
            plan = internal_pb2.StepPlan(step_id=self.step_id, dropped_slots=dropped)
            dropped = []
            budget = self.token_budget or 1 << 30
            scheduled = []
            for s in seqs:
                if s.done or budget == 0:
                    continue
                n = min(len(s.token_ids) - s.num_computed, budget, self.chunk_size or 1 << 30)
                budget -= n
                need = -(-(s.num_computed + n) // self.block_size) - len(s.blocks)
                new_blocks = [self.free.pop(0) for _ in range(max(0, need))]
                s.blocks += new_blocks
                if not s.sent:
                    plan.new_seqs.add(seq_id=f"s{s.slot}", slot=s.slot, token_ids=s.token_ids, sampling=s.sampling,
                                      num_computed_tokens=s.num_computed, block_ids=s.blocks,
                                      num_new_tokens=n)
                    s.sent = True
                else:
                    add_running(plan, s.slot, n, new_blocks)
                scheduled.append((s, n))
            self.plans.append(plan)
            result = self.runner.execute(plan)
            assert not result.error, result.error
            for row, (slot, token) in enumerate(zip(unpack_list(result.slots), unpack_list(result.token_ids))):
                s = seqs[slot]
                s.token_ids.append(token)
                s.output.append(token)
                s.logits.append(self.sampled_logits[row].clone())
            for s, n in scheduled:
                s.num_computed += n
                if s.done:
                    dropped.append(s.slot)
                    self.free += s.blocks
            self.step_id += 1
        return seqs
