"""A step's logprobs: of the sampled tokens, and of the prompt tokens the step computed, for the
sequences that asked, as the Logprobs messages of its StepResult. The logits are the raw
model's (docs/design.md's rule): the ones before any processor, temperature or grammar mask."""
from __future__ import annotations

import numpy as np
import torch

from proto import internal_pb2
from proto.columns import pack, pack_f32
from worker.step.logits import compute_logprobs

# Prompt logprobs take a [rows, vocab] logits tensor: bound it (49152 x 512 floats = 100 MB).
PROMPT_LOGPROBS_ROWS = 512


def sampled_logprobs(slots, params, logits, sampled, positions, result, skip=()) -> None:
    """Logprobs of the sampled tokens, for the sequences that asked; rows in `skip` (those that
    speculated: run_logprobs) are left to the caller."""
    asking = [i for i, p in enumerate(params)
              if (p.HasField("logprobs") or p.beam_candidates) and sampled[i] >= 0 and i not in skip]
    if not asking:
        return
    index = torch.tensor(asking, device=logits.device)
    ks = [max(params[i].logprobs, params[i].beam_candidates) for i in asking]
    chosen = sampled[index]
    lps = compute_logprobs(logits[index], chosen, max(ks))
    for j, (i, k) in enumerate(zip(asking, ks)):
        result.logprobs.append(
            logprobs_message(int(slots[i]), False, positions[i], chosen, lps, j, j + 1, k))


def prompt_logprobs(batch, compute_logits, slots, counts, hidden, result) -> None:
    """Logprobs of the prompt tokens this step computed, for the sequences that asked: the
    row of position p scores the prompt token at p + 1. The last prompt position scores the
    first output token instead, which is sampled, not scored here. batch: the worker's
    InputBatch before the step advances it."""
    offset = 0
    for slot, n in zip(slots.tolist(), counts.tolist()):
        sampling = batch.sampling[slot]
        if sampling.HasField("prompt_logprobs"):
            k = sampling.prompt_logprobs
            start, stop = int(batch.num_computed[slot]), int(batch.num_computed[slot]) + n
            last = int(batch.num_prompt[slot]) - 1
            for lo in range(start, min(stop, last), PROMPT_LOGPROBS_ROWS):
                hi = min(lo + PROMPT_LOGPROBS_ROWS, stop, last)
                logits = compute_logits(hidden[offset + lo - start:offset + hi - start])
                targets = torch.from_numpy(batch.tokens(slot, lo + 1, hi + 1).astype(np.int64))
                lps = compute_logprobs(logits, targets.to(logits.device), k)
                result.logprobs.append(
                    logprobs_message(slot, True, lo + 1, targets, lps, 0, hi - lo, k))
        offset += n


def logprobs_message(slot: int, prompt: bool, first_position: int, token_ids: torch.Tensor,
                     lps, lo: int, hi: int, k: int) -> internal_pb2.SlotLogprobs:
    """Rows lo:hi of compute_logprobs' output, with the top k of each, as a SlotLogprobs message."""
    values, ranks, top_ids, top_values = (t[lo:hi].cpu() for t in lps)
    return internal_pb2.SlotLogprobs(
        slot=slot, prompt=prompt, first_position=first_position,
        token_ids=pack(token_ids[lo:hi].cpu().numpy()), logprobs=pack_f32(values.float().numpy()),
        ranks=pack(ranks.numpy()), k=k, top_token_ids=pack(top_ids[:, :k].reshape(-1).numpy()),
        top_logprobs=pack_f32(top_values[:, :k].reshape(-1).float().numpy()))


def run_logprobs(slot: int, k: int, first_position: int, raw: torch.Tensor, run: list[int],
                 result) -> None:
    """Logprobs of a speculating row's run of tokens (its accepted proposals, then the target's),
    from the raw logits at their positions: one message of len(run) positions. The gateway keeps
    only those of the tokens the scheduler kept (a stop inside the run drops the rest)."""
    tokens = torch.tensor(run, dtype=torch.int64, device=raw.device)
    lps = compute_logprobs(raw[:len(run)], tokens, k)
    result.logprobs.append(logprobs_message(slot, False, first_position, tokens, lps, 0, len(run), k))
