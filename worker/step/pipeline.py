"""The worker's step as a fixed sequence: apply the plan, prepare the inputs, forward, sample,
advance the batch, pack the result. Features take part as hooks (worker/step/hook.py) at named
points; nothing here asks which features a worker has.

Under tensor parallelism (worker/parallel/tensor_parallel.py) every rank runs every stage but the sampling: rank
0 samples and sends the tokens (with what its hooks share) to the others, which receive them in
its place; the choice is made once, when the pipeline is built.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from proto import internal_pb2
from proto.columns import pack, unpack
from worker.model.attention_metadata import AttentionMetadata
from worker.model.kv_cache import CacheEngine
from worker.step.input_batch import InputBatch, StepInputs
from worker.parallel.tensor_parallel import TensorParallel
from worker.step.sampler import Sampler, plain_greedy
from worker.step.hook import Step, StepHook
from worker.step.logprobs import prompt_logprobs, sampled_logprobs


def inputs_on(device: torch.device, inputs: StepInputs) -> StepInputs:
    """A step's inputs on the model's device (as they are on the CPU)."""
    if device.type == "cpu":
        return inputs

    def to(t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory().to(device, non_blocking=True)
    m = inputs.meta
    meta = AttentionMetadata(to(m.slot_mapping), to(m.block_tables), to(m.seq_lens),
                             to(m.query_start_loc), m.max_seq_len, m.max_query_len)
    return StepInputs(to(inputs.input_ids), to(inputs.positions), meta,
                      to(inputs.logits_indices), inputs.sampled_slots, inputs.sample_positions)


class StepPipeline:
    def __init__(self, model, cache: CacheEngine, sampler: Sampler, tp: TensorParallel,
                 prepare_inputs: Callable[..., StepInputs], new_batch: Callable[[], InputBatch],
                 hooks: Sequence[StepHook]) -> None:
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.tp = tp
        self.prepare_inputs = prepare_inputs  # (slots, counts, batch) -> inputs on the device
        self.new_batch = new_batch
        self.batch = new_batch()
        self.hooks = list(hooks)
        # Each point's overriding hooks, once: a point no hook uses costs the step nothing.
        self._at = {name: [getattr(h, name) for h in self.hooks
                           if getattr(type(h), name) is not getattr(StepHook, name)]
                    for name in vars(StepHook) if not name.startswith("_")}
        self._sample = self._sample_here if tp.rank == 0 else self._receive_tokens

    def forget(self) -> None:
        self.batch = self.new_batch()
        for forget in self._at["forget"]:
            forget()

    def run(self, plan: internal_pb2.StepPlan, result: internal_pb2.StepResult) -> None:
        step = Step(plan, result, self.batch)
        if not self._apply_plan(step):
            return
        for prepare in self._at["prepare"]:
            prepare(step)
        try:
            self._prepare_inputs(step)
            self._forward(step)
            self._sample(step)
        except Exception:
            for undo in self._at["undo"]:
                undo(step)
            raise
        self._advance(step)
        self._pack(step)

    # ------------------------------------------------------------------ the stages

    def _apply_plan(self, step: Step) -> bool:
        """The plan's diff to the batch and the cache; the rows that compute this step, in plan
        order (new sequences first, then the held ones; the result follows it). False: none."""
        plan, batch = step.plan, step.batch
        batch.drop(plan.dropped_slots)
        for drop in self._at["drop"]:
            drop(plan.dropped_slots)
        self.cache.swap_out(plan.swap_out)
        self.cache.swap_in(plan.swap_in)
        self.cache.copy(plan.copy)
        for new in plan.new_seqs:
            sampling = internal_pb2.SamplingConfig()
            sampling.CopyFrom(new.sampling)
            batch.add(new.slot, new.token_ids, new.block_ids, new.num_computed_tokens,
                      new.num_prompt_tokens, sampling)
            for add in self._at["add"]:
                add(new, sampling)
        batch.append_blocks(unpack(plan.new_block_slots).astype(np.int64),
                            unpack(plan.new_block_ids))
        for apply_plan in self._at["apply_plan"]:
            apply_plan(step)
        running = unpack(plan.running_slots).astype(np.int64)
        batch.check_held(running)
        slots = np.concatenate([np.fromiter((n.slot for n in plan.new_seqs), np.int64,
                                            len(plan.new_seqs)), running])
        counts = np.concatenate([np.fromiter((n.num_new_tokens for n in plan.new_seqs), np.int64,
                                             len(plan.new_seqs)),
                                 unpack(plan.running_num_tokens).astype(np.int64)])
        if len(slots) != len(counts) or len(np.unique(slots)) != len(slots):
            raise ValueError("a plan names a slot twice, or slots and counts differ in number")
        work = counts > 0
        step.slots, step.counts = slots[work], counts[work]
        return bool(len(step.slots))

    def _prepare_inputs(self, step: Step) -> None:
        step.inputs = self.prepare_inputs(step.slots, step.counts, step.batch)
        step.sampled_slots = step.inputs.sampled_slots

    def _forward(self, step: Step) -> None:
        inputs = step.inputs
        step.hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.cache.kv_caches)

    def _sample_here(self, step: Step) -> None:
        """Rank 0: sample, then send the tokens to the other ranks (None: they fail the step too)."""
        try:
            self._sample_rows(step)
        except Exception:
            self.tp.send_tokens(None)
            raise
        if self.tp.size > 1:
            shared = [v for shared in self._at["shared"] for v in shared(step)]
            self.tp.send_tokens(np.concatenate([step.tokens, shared]) if shared else step.tokens)

    def _receive_tokens(self, step: Step) -> None:
        """Another rank: rank 0's tokens, and what its hooks shared, in their order."""
        hooks = [h for h in self.hooks if type(h).take_shared is not StepHook.take_shared]
        counts = [h.num_shared(step) for h in hooks]
        n = len(step.sampled_slots)
        values = self.tp.receive_tokens(n + sum(counts))
        step.tokens, at = values[:n], n
        for hook, count in zip(hooks, counts):
            hook.take_shared(step, values[at:at + count].tolist())
            at += count

    def _sample_rows(self, step: Step) -> None:
        """Prompt logprobs, then each sampling row's next token and its logprobs."""
        batch, inputs, hidden = step.batch, step.inputs, step.hidden
        prompt_logprobs(batch, self.model.compute_logits, step.slots, step.counts, hidden, step.result)
        sampled_slots = step.sampled_slots
        if not len(sampled_slots):
            step.tokens = np.zeros(0, np.int64)
            return
        idx, slot_list = inputs.logits_indices, sampled_slots.tolist()
        step.params = params = [batch.sampling[s] for s in slot_list]
        needed = [needs_logits(step) for needs_logits in self._at["needs_logits"]]  # each asked
        if not any(needed) and all(map(plain_greedy, params)):
            # The max of each row's logits, the LM head and the max in one pass where a kernel
            # does both (None: not here)
            tokens = self.model.greedy_tokens(hidden[idx])
            if tokens is not None:
                step.tokens = tokens.numpy()
                return
        self._logits(step)
        step.history = [batch.tokens(s) for s in slot_list]
        masks = [m for mask in self._at["mask"] if (m := mask(step)) is not None]
        if len(masks) > 1:  # the sampler applies one bitmask; two would have to be combined first
            raise NotImplementedError("two hooks mask the same step's logits")
        step.sampled = self.sampler(step.logits, params, inputs.sample_positions, step.history,
                                    batch.num_prompt[sampled_slots].tolist(), masks[0] if masks else None)
        for after_sample in self._at["after_sample"]:
            after_sample(step)
        sampled_logprobs(sampled_slots, params, step.logits, step.sampled, inputs.sample_positions,
                         step.result, step.skip_logprobs)
        step.tokens = step.sampled.cpu().numpy()

    def _logits(self, step: Step) -> None:
        """The sampled rows' raw logits, and those the hooks ask for, in one pass over the LM head."""
        idx = step.inputs.logits_indices
        extra = [(hook.__self__, rows) for hook in self._at["logits_rows"]
                 if (rows := hook(step)) is not None]
        if extra:
            idx = torch.cat([idx, *(rows.to(idx.device) for _, rows in extra)])
        logits = self.model.compute_logits(step.hidden[idx])
        at = len(step.sampled_slots)
        step.logits = logits[:at]
        for hook, rows in extra:
            step.extra_logits[hook], at = logits[at:at + len(rows)], at + len(rows)

    def _advance(self, step: Step) -> None:
        """The batch takes the step: its computed counts, then the sampled tokens."""
        batch = step.batch
        batch.advance(step.slots, step.counts)
        for settle in self._at["settle"]:
            settle(step)
        if (step.tokens < 0).any():  # failed rows (result.failed) keep no token
            kept = step.tokens >= 0
            step.sampled_slots, step.tokens = step.sampled_slots[kept], step.tokens[kept]
        keep = None
        for appended in self._at["appended"]:
            if (rows := appended(step)) is not None:
                keep = rows if keep is None else keep & rows
        if keep is None:
            batch.append_tokens(step.sampled_slots, step.tokens)
        else:
            batch.append_tokens(step.sampled_slots[keep], step.tokens[keep])
        for accept in self._at["accept"]:
            accept(step)

    def _pack(self, step: Step) -> None:
        if any(pack_tokens(step) for pack_tokens in self._at["pack"]):
            return
        step.result.slots = pack(step.sampled_slots)
        step.result.token_ids = pack(step.tokens)
