"""Speculative decoding in the worker (n-gram or draft-model proposals, verified in the step's
own forward).

The plan names rows that compute one decode token and may propose up to k more
(StepPlan.spec_slots). Before the forward, each such row's proposals are written after its
known tokens in the persistent batch and its query grows to 1 + p tokens, so the forward
computes the target's distributions at all of them; the rejection sampler
(worker/speculation/rejection_sampler.py) keeps the accepted prefix and draws one token of the target's
after it. `settle` then makes the batch say what is true: the accepted proposals stay as known
and computed tokens (their KV is in the cache), the rejected ones are forgotten (their KV
slots are overwritten by later steps). The scheduler allocated the blocks for all of them.

Only rows whose sampling the verification reproduces speculate (proto/speculation.py: no
beams); every rank proposes the same tokens from its own copy of the batch, and rank 0 alone
verifies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from process_life.flag_errors import FlagError
from proto.columns import pack, unpack
from proto.speculation import may_speculate
from worker.grammar.matchers import GrammarRows, apply_grammar_mask
from worker.step.input_batch import InputBatch
from worker.speculation import ngram_proposer, suffix_proposer
from worker.speculation.rejection_sampler import verify
from worker.step.logprobs import run_logprobs
from worker.step.sampler import SAMPLING_EPS, apply_processors, probabilities
from worker.speculation.config import SpeculativeConfig


@dataclass
class Proposals:
    """One step's proposals: row indices into the step's slots, and each one's draft tokens."""
    rows: list[int] = field(default_factory=list)
    drafts: list[np.ndarray] = field(default_factory=list)
    known: list[int] = field(default_factory=list)   # each row's known tokens before them
    accepted: list[int] = field(default_factory=list)  # set by verify_rows (or by rank 0)


def build_speculator(text: str | None, runner) -> "Speculator | None":
    """The --speculative-config's Speculator (None without the flag), its draft model loaded
    for the runner's vocabulary, attention backend, length, device and dtype; SystemExit naming
    the field when the flag is wrong (FlagError)."""
    if not text:
        return None
    try:
        config = SpeculativeConfig.parse(text)
    except ValueError as e:
        raise FlagError(str(e)) from None
    draft = None
    if config.method == "draft_model":
        from worker.speculation.draft_model import DraftModel
        draft = DraftModel(config.model, runner.config.vocab_size, runner.backend,
                           runner.max_model_len, runner.device, runner.dtype,
                           fused_decode=runner.args.cpu_matmul == "auto")
    return Speculator(config, draft, runner.prepare_inputs)


class Speculator:
    """Proposes (n-gram lookup, or a draft model: worker/speculation/draft_model.py), verifies, settles."""

    def __init__(self, config: SpeculativeConfig, draft=None, prepare=None) -> None:
        self.config = config
        self.draft = draft          # a DraftModel for method draft_model
        self.prepare = prepare      # ModelRunner.prepare_inputs, for the draft's forwards

    def draft_bytes_per_block(self, block_size: int) -> int:
        return self.draft.bytes_per_block(block_size) if self.draft else 0

    def allocate_draft_cache(self, num_blocks: int, block_size: int) -> None:
        if self.draft:
            self.draft.allocate_cache(num_blocks, block_size)

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def hello_fields(self) -> dict:
        """What the scheduler needs to know of it (WorkerHello)."""
        return {"num_speculative_tokens": self.num_speculative_tokens,
                "speculative_disable_by_batch_size": self.config.disable_by_batch_size,
                "speculative_paced_by_worker": self.config.paced_by_worker}

    def propose(self, batch: InputBatch, plan_spec_slots: bytes, plan_spec_k: bytes,
                slots: np.ndarray, counts: np.ndarray) -> Proposals:
        """Writes each speculating row's proposals into the batch and grows its count in place."""
        out = Proposals()
        spec_slots, spec_k = unpack(plan_spec_slots), unpack(plan_spec_k)
        if len(spec_slots) != len(spec_k):
            raise ValueError("a plan's spec_slots and spec_num_tokens differ in length")
        if not len(spec_slots):
            return out
        if (spec_k < 1).any() or (spec_k > self.num_speculative_tokens).any():
            raise ValueError(f"a plan proposes outside [1, {self.num_speculative_tokens}] tokens")
        row_of = {int(s): i for i, s in enumerate(slots.tolist())}
        for slot, k in zip(spec_slots.tolist(), spec_k.tolist()):
            row = row_of.get(slot)
            n = int(batch.num_tokens[slot]) if row is not None else -1
            if row is None or counts[row] != 1 or batch.num_computed[slot] != n - 1:
                raise ValueError(f"slot {slot} speculates but is not a decode of this step")
            if not may_speculate(batch.sampling[slot]):
                raise ValueError(f"slot {slot} speculates, but its sampling needs one token a step")
            if n + k > batch.max_model_len:
                raise ValueError(f"slot {slot}: {k} proposals run past max_model_len")
        for slot, draft in zip(spec_slots.tolist(), self._drafts(batch, spec_slots, spec_k)):
            if not len(draft):
                continue
            row, n = row_of[slot], int(batch.num_tokens[slot])
            batch.token_ids[slot, n:n + len(draft)] = draft
            batch.num_tokens[slot] = n + len(draft)
            counts[row] += len(draft)
            out.rows.append(row)
            out.drafts.append(draft)
            out.known.append(n)
        return out

    def _drafts(self, batch: InputBatch, slots: np.ndarray, k: np.ndarray) -> list[np.ndarray]:
        if self.draft is not None:
            return self.draft.propose(batch, slots.astype(np.int64), k.astype(np.int64), self.prepare)
        cfg = self.config
        if cfg.method == "suffix":
            return [suffix_proposer.propose(batch.tokens(s), n, cfg.suffix_decoding_max_tree_depth,
                                            cfg.suffix_decoding_max_spec_factor,
                                            cfg.suffix_decoding_min_token_prob)
                    for s, n in zip(slots.tolist(), k.tolist())]
        return [ngram_proposer.propose(batch.tokens(s), n, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
                for s, n in zip(slots.tolist(), k.tolist())]

    @staticmethod
    def draft_logits_indices(spec: Proposals, counts: np.ndarray) -> torch.Tensor:
        """Rows of the hidden states at each proposal's position, from the step's query counts on
        the host (no read of the device's query_start_loc); the row's last position (after its
        last proposal) is among the step's sampled rows already."""
        starts = np.cumsum(counts) - counts
        idx = [int(starts[r]) + j for r, d in zip(spec.rows, spec.drafts) for j in range(len(d))]
        return torch.tensor(idx, dtype=torch.int64)

    def verify_rows(self, spec: Proposals, batch: InputBatch, grammar: GrammarRows,
                    slots: np.ndarray, sampled_slots: np.ndarray, params, history: list,
                    draft_logits: torch.Tensor, logits: torch.Tensor, sampled: torch.Tensor,
                    generator: torch.Generator, result) -> tuple[list[list[int]], set[int]]:
        """Each speculating row's tokens (accepted proposals, then the target's), and those rows'
        places among the sampled rows; writes the target's token into `sampled` at the row's
        place, fills spec.accepted and cuts the row's `history` back to its known tokens. Position i
        of a row sees the logits processors with the row's tokens and proposals 0..i-1 as its
        history: penalties, logit_bias and min_tokens act as if those had been sampled. Rows
        that asked for logprobs get those of their whole run (from the raw logits) in result.
        A constrained row is masked at each position by its grammar as it would stand there
        (worker/grammar/matchers.py draft_masks): proposals past the first one the grammar refuses are
        not verified, and a position that leaves no token ends the run before it (the next step
        finds it so and fails the row as a plain step would); at the first position, the row
        gets -1, which the caller's failure path reports."""
        place = {s: i for i, s in enumerate(sampled_slots.tolist())}
        runs, at = [], 0
        for row, draft, n in zip(spec.rows, spec.drafts, spec.known):
            slot = int(slots[row])
            i = place[slot]
            p = len(draft)
            param = [params[i]] * (p + 1)
            tokens = batch.tokens(slot)  # the known tokens, then the proposals
            raw = torch.cat([draft_logits[at:at + p], logits[i:i + 1]])
            target = apply_processors(raw, param,
                                      [tokens[:n + j] for j in range(p + 1)],
                                      [int(batch.num_prompt[slot])] * (p + 1))
            at += p
            masks = grammar.draft_masks(slot, draft, raw.shape[1]) if grammar.matchers else None
            if masks is not None:
                bitmask, m = masks
                target = apply_grammar_mask(target[:m + 1], list(range(m + 1)), bitmask)
                dead = torch.isneginf(target).all(dim=-1).nonzero().flatten().tolist()
                if dead and dead[0] == 0:
                    sampled[i] = -1
                    spec.accepted.append(0)
                    runs.append([])
                    continue
                p = min(m, dead[0] - 1) if dead else m
                target, draft = target[:p + 1], draft[:p]
            param = params[i]
            greedy = param.temperature < SAMPLING_EPS
            probs = target if greedy else probabilities(target, [param] * (p + 1))
            seed = param.seed if param.has_seed else None
            v = verify(probs, draft.tolist(), None, greedy, seed, n, generator)
            sampled[i] = v.tokens[-1]
            spec.accepted.append(v.accepted)
            runs.append(v.tokens)
            if masks is not None:
                grammar.advance(slot, v.tokens[:-1])
            if param.HasField("logprobs"):
                run_logprobs(slot, param.logprobs, n, raw, v.tokens, result)
        for row, n in zip(spec.rows, spec.known):  # a failure names the count before proposals
            history[place[int(slots[row])]] = history[place[int(slots[row])]][:n]
        return runs, {place[int(slots[row])] for row in spec.rows}

    def undo(self, batch: InputBatch, slots: np.ndarray, spec: Proposals) -> None:
        """A step that failed: the rows know only their own tokens again (and a draft model's
        cache holds none of the proposals')."""
        for row, n in zip(spec.rows, spec.known):
            batch.num_tokens[slots[row]] = n
            if self.draft is not None:
                self.draft.settle(batch, slots[row], n, 0)

    def settle(self, batch: InputBatch, slots: np.ndarray, spec: Proposals) -> None:
        """After the batch advanced by the step's counts: keep the accepted proposals as known
        and computed tokens, forget the rest (the target's token is appended next)."""
        for row, draft, n, a in zip(spec.rows, spec.drafts, spec.known, spec.accepted):
            slot = slots[row]
            batch.num_tokens[slot] = n + a
            batch.num_computed[slot] -= len(draft) - a
            if self.draft is not None:
                self.draft.settle(batch, slot, n, a)


def result_columns(result, sampled_slots: np.ndarray, tokens: np.ndarray, slots: np.ndarray,
                   spec: Proposals, runs: list[list[int]]) -> None:
    """StepResult's token columns when rows speculated: each sampled row's run of tokens (one for
    a row that proposed nothing) and how many of them were proposals."""
    run_of = {int(slots[r]): (run, len(d)) for r, run, d in zip(spec.rows, runs, spec.drafts)}
    token_ids, num_tokens, num_drafts = [], [], []
    for s, t in zip(sampled_slots.tolist(), tokens.tolist()):
        run, p = run_of.get(s, ((t,), 0))
        token_ids += run
        num_tokens.append(len(run))
        num_drafts.append(p)
    result.slots = pack(sampled_slots)
    result.token_ids = pack(token_ids)
    result.num_tokens = pack(num_tokens)
    result.num_drafts = pack(num_drafts)
