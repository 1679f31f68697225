"""Logits processors, applied in vLLM's order, and logprobs.

The sampler runs: min_tokens mask, logit_bias, penalties (all three before greedy argmax, as in
vLLM, so greedy rows see them too), then temperature, min_p, top-k/top-p. Each function here
is pure: it returns its input tensor untouched when no row uses the feature (a batch of plain
requests pays nothing), otherwise a new tensor in which only the rows that use it changed.
Rows are processed together, so a row's result does not depend on what shares the batch.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch


class LogitsParams(Protocol):  # internal_pb2.SamplingConfig has these fields
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: dict[int, float]
    min_tokens: int
    stop_token_ids: Sequence[int]


def apply_min_tokens(logits: torch.Tensor, params: Sequence[LogitsParams],
                     num_output_tokens: Sequence[int]) -> torch.Tensor:
    """-inf on the stop_token_ids of rows that have fewer than min_tokens output tokens."""
    rows: list[int] = []
    cols: list[int] = []
    for i, (p, n) in enumerate(zip(params, num_output_tokens)):
        if n < p.min_tokens:
            rows.extend([i] * len(p.stop_token_ids))
            cols.extend(p.stop_token_ids)
    if not rows:
        return logits
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


def apply_logit_bias(logits: torch.Tensor, params: Sequence[LogitsParams]) -> torch.Tensor:
    """logits[row, id] += bias for each (id, bias) of the row's logit_bias."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(params):
        for tok, bias in p.logit_bias.items():
            rows.append(i)
            cols.append(tok)
            vals.append(bias)
    if not rows:
        return logits
    dev = logits.device
    index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
    return logits.index_put(index, torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)


def _repetition(p: LogitsParams) -> float:
    # proto3 sends 0 for unset; 0 would zero every seen logit, so it means off like 1.
    return p.repetition_penalty if p.repetition_penalty > 0 else 1.0


def apply_penalties(logits: torch.Tensor, params: Sequence[LogitsParams],
                    token_ids: Sequence[Sequence[int]],
                    num_prompt_tokens: Sequence[int]) -> torch.Tensor:
    """vLLM's penalties. The repetition penalty r hits tokens seen in the prompt or the output:
    a positive logit is divided by r, any other multiplied by it. Then, from output tokens only,
    logit -= frequency_penalty * count + presence_penalty * (count > 0).
    token_ids[i] is row i's sequence so far; its first num_prompt_tokens[i] are the prompt."""
    rows = [i for i, p in enumerate(params) if len(token_ids[i]) and (
        _repetition(p) != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    seqs = [token_ids[i] for i in rows]
    lens = torch.tensor([len(s) for s in seqs], device=dev)
    flat = torch.from_numpy(np.concatenate([np.asarray(s, np.int64) for s in seqs])).to(dev)
    row_of = torch.repeat_interleave(torch.arange(len(rows), device=dev), lens)
    # Index of each token within its own sequence, to tell prompt from output.
    starts = torch.cumsum(lens, 0) - lens
    offset = torch.arange(flat.numel(), device=dev) - starts[row_of]
    prompt_len = torch.tensor([num_prompt_tokens[i] for i in rows], device=dev)
    is_output = offset >= prompt_len[row_of]
    # One flat bin per (row, token) so a single bincount counts every row at once.
    key = row_of * vocab + flat
    counts = torch.bincount(key[is_output], minlength=len(rows) * vocab).view(len(rows), vocab)
    seen = torch.zeros(len(rows) * vocab, dtype=torch.bool, device=dev)
    seen[key] = True

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=dev).unsqueeze(1)

    sub = [params[i] for i in rows]
    rep = column([_repetition(p) for p in sub])
    freq = column([p.frequency_penalty for p in sub])
    pres = column([p.presence_penalty for p in sub])
    rows_t = torch.tensor(rows, device=dev)
    x = logits[rows_t]
    x = torch.where(seen.view(len(rows), vocab), torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * counts.to(x.dtype) - pres * (counts > 0).to(x.dtype)
    return logits.index_copy(0, rows_t, x)


def apply_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Masks tokens whose probability is below min_p times the row's highest probability.
    Call it after temperature: the probabilities are those of the logits given."""
    rows = [i for i, m in enumerate(min_p) if m > 0.0]
    if not rows:
        return logits
    dev = logits.device
    rows_t = torch.tensor(rows, device=dev)
    x = logits[rows_t]
    probs = x.softmax(dim=-1)
    m = torch.tensor([min_p[i] for i in rows], dtype=probs.dtype, device=dev).unsqueeze(1)
    x = x.masked_fill(probs < m * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits.index_copy(0, rows_t, x)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the raw logits [S, V] (before any processing, as vLLM reports them):
    (logprob of token_ids [S] float32, its 1-based rank [S] int64 = 1 + the number of tokens
    strictly more likely, the top k ids [S, k] int64 best first, their logprobs [S, k] float32)."""
    # float32 whatever the model's dtype: bf16 log_softmax is off by ~1e-2.
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, token_ids.unsqueeze(1))
    ranks = (lp > chosen).sum(dim=-1) + 1
    top_logprobs, top_ids = lp.topk(k, dim=-1)
    return chosen.squeeze(1), ranks, top_ids, top_logprobs
