"""Proposals from a draft model (--speculative-config method draft_model), in the worker's own
process, with a paged KV cache of its own in step with the target's blocks.

The draft's cache has as many blocks as the target's and is addressed through the same block
tables, so the scheduler's allocation (the lookahead slots included) covers both and nothing
else has to be kept in step. Each row of the persistent batch says how many of its tokens have
their KV in the draft's cache (InputBatch.num_draft_computed); a row the plan adds (new, or back
from a preemption or a swap, whose blocks the draft's cache never held) starts at 0, and the
draft catches up on its tokens the first time the row speculates, in chunks. Then it decodes k
tokens greedily, one forward per token over every speculating row at once.

Greedy drafting makes each proposal one-hot, which the rejection sampler verifies exactly as it
does n-gram proposals (vLLM's draft proposers do the same): the output keeps the target's
distribution, whatever the draft. Under tensor parallelism every rank runs the whole draft
(it is not sharded) on the same tokens, so every rank proposes the same ones.
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from process_life.flag_errors import FlagError
from modelfiles.resolve import resolve_model
from worker.model.attention_backends import AttentionBackend
from worker.model.kv_cache import CacheEngine, bytes_per_block
from worker.step.input_batch import InputBatch, StepInputs
from worker.model.loader import load_weights
from worker.model.llama import build_model
from worker.parallel.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

# The most tokens one catch-up forward computes (a long prompt's first speculation).
CATCH_UP_TOKENS = 2048

Prepare = Callable[[np.ndarray, np.ndarray, InputBatch, np.ndarray], StepInputs]


class DraftModel:
    def __init__(self, path: str, vocab_size: int, backend: AttentionBackend, max_model_len: int,
                 device: torch.device, dtype: torch.dtype, fused_decode: bool = False) -> None:
        try:
            resolved = resolve_model(path, "--speculative-config.model")
        except FileNotFoundError as e:
            raise FlagError(str(e)) from None
        self.config, weights = load_weights(resolved)
        if self.config.vocab_size != vocab_size:
            raise FlagError(f"--speculative-config.model: the draft's vocabulary has "
                             f"{self.config.vocab_size} tokens, the target's {vocab_size}; "
                             "a draft must share the target's tokenizer")
        self.model = build_model(self.config, weights, backend, max_model_len, device, dtype,
                                 TensorParallel(), fused_decode=fused_decode)
        self.dtype, self.device = dtype, device
        self.cache: CacheEngine | None = None
        logger.info("draft model %s: %d layers, %d hidden", resolved, self.config.num_layers,
                    self.config.hidden_size)

    def bytes_per_block(self, block_size: int) -> int:
        return bytes_per_block(self.config, block_size, self.dtype)

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        """As many blocks as the target's, no swap area: a swapped row starts again at 0."""
        self.cache = CacheEngine(self.config, num_blocks, 0, block_size, self.dtype, self.device)

    def propose(self, batch: InputBatch, slots: np.ndarray, k: np.ndarray,
                prepare: Prepare) -> list[np.ndarray]:
        """Up to k[i] greedy proposals after the known tokens of row slots[i]. The proposals are
        written after each row's tokens as they come (the next forward reads them there), and the
        rows' known counts are put back as they were before returning."""
        known = batch.num_tokens[slots].copy()
        drafts = np.zeros((len(slots), int(k.max())), np.int64)
        rows = np.arange(len(slots))
        try:
            self._catch_up(batch, slots, known, prepare)
            for j in range(int(k.max())):
                rows = rows[k[rows] > j]
                s = slots[rows]
                starts = batch.num_draft_computed[s]
                tokens = self._forward(batch, s, batch.num_tokens[s] - starts, starts, prepare)
                batch.num_draft_computed[s] = batch.num_tokens[s]
                drafts[rows, j] = tokens
                batch.token_ids[s, batch.num_tokens[s]] = tokens
                batch.num_tokens[s] += 1
        except BaseException:  # the step fails: the draft's cache holds no proposal's KV
            batch.num_draft_computed[slots] = np.minimum(batch.num_draft_computed[slots], known)
            raise
        finally:
            batch.num_tokens[slots] = known
        # The last proposal's KV is not computed: the draft's cache holds up to the one before.
        return [drafts[i, :k[i]] for i in range(len(slots))]

    @staticmethod
    def settle(batch: InputBatch, slot: int, known: int, accepted: int) -> None:
        """After the verification: the draft's KV stays valid up to the last accepted proposal."""
        batch.num_draft_computed[slot] = min(batch.num_draft_computed[slot], known + accepted)

    def _catch_up(self, batch: InputBatch, slots: np.ndarray, known: np.ndarray,
                  prepare: Prepare) -> None:
        """Computes the draft's KV of the rows' known tokens, chunk by chunk, until each row has
        at most a chunk left: the first proposal's forward computes that and samples."""
        chunk = max(1, CATCH_UP_TOKENS // len(slots))
        while True:
            todo = known - batch.num_draft_computed[slots] > chunk
            if not todo.any():
                return
            s = slots[todo]
            counts = np.full(len(s), chunk, np.int64)
            self.model(*self._inputs(prepare(s, counts, batch, batch.num_draft_computed[s])),
                       self.cache.kv_caches)
            batch.num_draft_computed[s] += chunk

    def _forward(self, batch: InputBatch, slots: np.ndarray, counts: np.ndarray,
                 starts: np.ndarray, prepare: Prepare) -> np.ndarray:
        inputs = prepare(slots, counts, batch, starts)
        hidden = self.model(*self._inputs(inputs), self.cache.kv_caches)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return logits.argmax(dim=-1).cpu().numpy()

    @staticmethod
    def _inputs(inputs: StepInputs) -> tuple:
        return inputs.input_ids, inputs.positions, inputs.meta
