"""Suffix proposals (vLLM's "suffix" method, after SuffixDecoding, arXiv 2411.04975), over each
sequence's own tokens: find the earlier places whose preceding tokens match the sequence's end
for as long as any does (up to max_depth), and follow them forward.

Unlike n-gram lookup, the draft's length follows the evidence: a match of L tokens proposes up
to factor * L tokens (a quote or an edit being copied matches long and proposes long; a
one-token match proposes one or two cheap rows), and the walk forward takes, at each position,
the token most of the matching places continue with (the most recent on a tie), stopping once
the product of those shares falls below min_prob. So it backs off by itself, token by token,
and the scheduler does not pause it (WorkerHello.speculative_paced_by_worker).

What vLLM's implementation (Arctic Inference) also does and this does not: a suffix tree kept
across requests. Proposals here come from the sequence alone: one tenant's answers never shape
another's drafts, not even through timing. The scan is O(tokens x depth) numpy work per step:
on 8,192 tokens 0.04 ms when they never repeat, 0.5 ms for text of period 50, 2.0 ms at worst
(one token repeated, every place matching to the full depth), against n-gram's 0.3-1.2 ms on the
same (AVX2 EPYC). With the default disable_by_batch_size, at most 8 sequences propose a step."""
from __future__ import annotations

import numpy as np


def propose(tokens: np.ndarray, k: int, max_depth: int, factor: float, min_prob: float) -> np.ndarray:
    """Up to k proposed next tokens for a sequence of `tokens` (int array); empty when its last
    token never occurred before or the first continuation is too uncertain."""
    size = len(tokens)
    if size < 2 or k < 1:
        return tokens[:0].copy()
    # starts[i]: the position right after an earlier match of the last `length` tokens.
    starts = np.flatnonzero(tokens[:size - 1] == tokens[size - 1]) + 1
    length = 1
    while len(starts) and length < max_depth:
        longer = starts[starts > length]
        longer = longer[tokens[longer - length - 1] == tokens[size - 1 - length]]
        if not len(longer):
            break
        starts, length = longer, length + 1
    if not len(starts):
        return tokens[:0].copy()
    out: list[int] = []
    share = 1.0
    for j in range(min(k, max(1, int(factor * length)))):
        starts = starts[starts + j < size]
        if not len(starts):
            break
        following = tokens[starts + j]
        values, counts = np.unique(following, return_counts=True)
        most = counts.max()
        best = values[counts == most]
        token = best[0] if len(best) == 1 else following[np.isin(following, best)][-1]
        share *= most / len(starts)
        if share < min_prob:
            break
        out.append(int(token))
        starts = starts[following == token]
    return np.asarray(out, dtype=tokens.dtype)
