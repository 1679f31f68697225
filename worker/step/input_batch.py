"""The worker's persistent batch: every sequence it holds is one row, indexed by its slot, in
arrays allocated once and patched in place by each plan (rows added and dropped, blocks appended,
counts moved, sampled tokens written). A step's model inputs are gathered from these rows with a
few array operations; nothing is rebuilt from per-sequence Python lists.

This is the worker's only copy of the sequences it holds: the plan carries diffs against it
(see proto/internal.proto).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from proto import internal_pb2
from worker.model.attention_metadata import AttentionMetadata

INITIAL_ROWS = 64
# The scheduler numbers slots densely from 0 (at most --max-num-seqs plus those in flight); a
# row costs about 4 bytes per token of max_model_len, so a bound keeps a bad plan from taking GBs.
MAX_ROWS = 1 << 13


@dataclass
class StepInputs:
    """One step's model inputs, on the host (the runner moves them to the device)."""
    input_ids: torch.Tensor         # int64 [T]
    positions: torch.Tensor         # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor    # int64 [S]: rows of the hidden states to sample
    sampled_slots: np.ndarray       # int64 [S]: whose rows they are
    sample_positions: list[int]     # index in its sequence of each token to be sampled


class InputBatch:
    def __init__(self, max_model_len: int, block_size: int, rows: int = INITIAL_ROWS) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        # A row holds its sequence up to one token past the limit: the last step samples one.
        self.width = max_model_len + 1
        self.max_blocks = -(-self.width // block_size)
        self.token_ids = np.zeros((rows, self.width), np.int32)
        self.block_table = np.zeros((rows, self.max_blocks), np.int32)
        self.num_tokens = np.zeros(rows, np.int64)       # known tokens (prompt + sampled)
        self.num_computed = np.zeros(rows, np.int64)     # tokens whose KV is in the cache
        # Tokens whose KV is in a draft model's cache (worker/speculation/draft_model.py); 0 when added.
        self.num_draft_computed = np.zeros(rows, np.int64)
        self.num_prompt = np.zeros(rows, np.int64)
        self.num_blocks = np.zeros(rows, np.int64)
        self.held = np.zeros(rows, bool)
        # Beam search rows: the scheduler names their next token in a later plan.
        self.beam = np.zeros(rows, bool)
        self.sampling: dict[int, internal_pb2.SamplingConfig] = {}  # by slot

    # ------------------------------------------------------------------ patches from a plan

    def add(self, slot: int, token_ids, block_ids, num_computed: int, num_prompt: int,
            sampling: internal_pb2.SamplingConfig) -> None:
        if len(token_ids) > self.width or len(block_ids) > self.max_blocks:
            raise ValueError(f"slot {slot}: {len(token_ids)} tokens in {len(block_ids)} blocks "
                             f"exceed max_model_len {self.max_model_len}")
        if not 0 <= slot < MAX_ROWS:
            raise ValueError(f"slot {slot} is out of range [0, {MAX_ROWS})")
        self._grow(slot + 1)
        self.token_ids[slot, :len(token_ids)] = token_ids
        self.block_table[slot, :len(block_ids)] = block_ids
        self.num_tokens[slot] = len(token_ids)
        self.num_blocks[slot] = len(block_ids)
        self.num_computed[slot] = num_computed
        self.num_draft_computed[slot] = 0
        self.num_prompt[slot] = num_prompt
        self.held[slot] = True
        self.beam[slot] = sampling.beam_candidates > 0
        self.sampling[slot] = sampling

    def drop(self, slots) -> None:
        for slot in slots:
            if slot < len(self.held):
                self.held[slot] = False
            self.sampling.pop(slot, None)

    def append_blocks(self, slots: np.ndarray, blocks: np.ndarray) -> None:
        """blocks[i] goes at the end of slots[i]'s table; a slot may appear several times."""
        if not len(slots):
            return
        self.check_held(slots)
        order = np.argsort(slots, kind="stable")
        s = slots[order]
        idx = np.arange(len(s))
        first = np.maximum.accumulate(np.where(np.r_[True, s[1:] != s[:-1]], idx, 0))
        at = self.num_blocks[s] + (idx - first)
        if (at >= self.max_blocks).any():
            raise ValueError("a block table grows past max_model_len")
        self.block_table[s, at] = blocks[order]
        np.add.at(self.num_blocks, s, 1)

    def check_held(self, slots: np.ndarray) -> None:
        if len(slots) and (slots.max() >= len(self.held) or not self.held[slots].all()):
            unknown = [int(s) for s in slots if s >= len(self.held) or not self.held[s]]
            raise KeyError(f"slots {unknown[:8]} are unknown to this worker")

    # ------------------------------------------------------------------ one step

    def prepare(self, slots: np.ndarray, counts: np.ndarray,
                starts: np.ndarray | None = None) -> StepInputs:
        """Row slots[i] computes counts[i] tokens from its num_computed on (from starts[i] for a
        draft model's forward); a row that reaches the end of its known tokens samples one."""
        bs = self.block_size
        starts = self.num_computed[slots] if starts is None else starts
        ends = starts + counts
        if (ends > self.num_tokens[slots]).any():
            raise ValueError("a step runs past the tokens its sequence has")
        if (ends > self.num_blocks[slots] * bs).any():
            raise ValueError("a step's tokens do not fit in their sequence's blocks")
        if (ends > self.max_model_len).any():
            raise ValueError(f"a step runs past max_model_len {self.max_model_len}")
        query_start_loc = np.zeros(len(slots) + 1, np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        # Token t of row i sits at position starts[i] + (t - query_start_loc[i]).
        row_of_token = np.repeat(np.arange(len(slots)), counts)
        positions = np.arange(num_tokens) + (starts - query_start_loc[:-1])[row_of_token]
        input_ids = self.token_ids[slots[row_of_token], positions].astype(np.int64)
        width = int(self.num_blocks[slots].max())
        block_tables = self.block_table[slots, :width]
        slot_mapping = block_tables[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        sampling = ends == self.num_tokens[slots]
        t = torch.from_numpy
        meta = AttentionMetadata(
            slot_mapping=t(slot_mapping), block_tables=t(block_tables),
            seq_lens=t(ends.astype(np.int32)), query_start_loc=t(query_start_loc.astype(np.int32)),
            max_seq_len=int(ends.max()), max_query_len=int(counts.max()))
        return StepInputs(t(input_ids), t(positions), meta, t(query_start_loc[1:][sampling] - 1),
                          slots[sampling], ends[sampling].tolist())

    def advance(self, slots: np.ndarray, counts: np.ndarray) -> None:
        self.num_computed[slots] += counts

    def append_tokens(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """The tokens sampled for these rows (the scheduler appends the same ones on its side),
        or those a plan names (beam search)."""
        if len(slots) and (self.num_tokens[slots] >= self.width).any():
            raise ValueError(f"a token past max_model_len {self.max_model_len}")
        self.token_ids[slots, self.num_tokens[slots]] = tokens
        self.num_tokens[slots] += 1

    # ------------------------------------------------------------------ reads

    def tokens(self, slot: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        n = int(self.num_tokens[slot])
        return self.token_ids[slot, start:n if stop is None else min(stop, n)]

    def _grow(self, rows: int) -> None:
        have = len(self.held)
        if rows <= have:
            return
        new = max(rows, 2 * have)
        for name in ("token_ids", "block_table", "num_tokens", "num_computed",
                     "num_draft_computed", "num_prompt", "num_blocks", "held", "beam"):
            old = getattr(self, name)
            grown = np.zeros((new, *old.shape[1:]), old.dtype)
            grown[:have] = old
            setattr(self, name, grown)
