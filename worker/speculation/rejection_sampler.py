"""Speculative sampling's accept / resample rule (Leviathan et al., Chen et al.; vLLM's
RejectionSampler): k proposed tokens are checked against the target model's distributions at
their k positions, in one verification forward, and the output has exactly the target's
distribution.

At position i, draft token d with draft probability q(d) is accepted with probability
min(1, p(d) / q(d)); the first rejection ends the run with a token drawn from the residual
max(p - q, 0) (renormalised), and a run with every proposal accepted gets a bonus token drawn
from the target at position k + 1. Each output token is therefore distributed as p. n-gram
proposals have no draft distribution: q is one-hot on d, so d is accepted with probability
p(d) and the residual is p without d. Greedy rows accept while d is the target's argmax and end
with the argmax.

Randomness depends on the seed and the position alone (worker/step/sampler.py seed_for), as the
plain sampler's does: a seeded request gives the same output in any batch, and every time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from worker.step.sampler import race, seed_for

_ACCEPT_SALT = 0x5EC0_DE00_0000_0001  # the accept test's draws, apart from the resample's


@dataclass
class Verified:
    tokens: list[int]  # the accepted proposals, then one token of the target's
    accepted: int      # how many proposals were accepted (len(tokens) - 1)


def verify(probs: torch.Tensor, draft: Sequence[int], draft_probs: torch.Tensor | None,
           greedy: bool, seed: int | None, first_position: int,
           generator: torch.Generator | None = None) -> Verified:
    """probs [k + 1, V]: the target's distributions at the k proposals' positions and the one
    after (after every logits processor, temperature, top-k and top-p); draft: the k proposed
    tokens; draft_probs [k, V] or None (one-hot proposals); first_position: the position of the
    first proposal in its sequence (the seeded draws depend on it); generator: for unseeded rows."""
    k = len(draft)
    assert probs.shape[0] == k + 1, (probs.shape, k)
    if greedy:
        best = probs.argmax(dim=-1).tolist()
        n = next((i for i in range(k) if draft[i] != best[i]), k)
        return Verified(list(draft[:n]) + [best[n]], n)
    if draft_probs is None:
        # One-hot q: accepting d with probability p(d), else drawing from p without d, is drawing
        # x ~ p and accepting d if x == d. Drawn as the plain sampler draws, a seeded row gives
        # the very tokens it gives without speculation, whatever k the step allowed.
        tokens = []
        for i in range(k + 1):
            tokens.append(race(probs[i], seed, first_position + i, generator))
            if i == k or tokens[-1] != int(draft[i]):
                return Verified(tokens, i)
    for i in range(k):  # a draft distribution q: accept d with min(1, p(d) / q(d)), else resample
        d = int(draft[i])
        p, q = float(probs[i, d]), float(draft_probs[i, d])
        if q > 0 and _uniform(seed, first_position + i, generator) * q <= p:
            continue
        residual = (probs[i] - draft_probs[i]).clamp_(min=0.0)
        if not residual.sum() > 0:  # p == q where both are defined: any draw of p will do
            residual = probs[i]
        return Verified(list(draft[:i]) + [_draw(residual, seed, first_position + i, generator)], i)
    return Verified(list(draft) + [_draw(probs[k], seed, first_position + k, generator)], k)


def _generator(seed: int | None, position: int, salt: int, generator: torch.Generator | None):
    if seed is None:
        return generator
    return torch.Generator().manual_seed(seed_for(seed ^ salt, position))


def _uniform(seed, position, generator) -> float:
    return float(torch.rand((), generator=_generator(seed, position, _ACCEPT_SALT, generator)))


def _draw(weights: torch.Tensor, seed, position, generator) -> int:
    """One token with probability proportional to weights, as the plain sampler draws (argmax of
    weights over exponential noise)."""
    noise = torch.empty_like(weights, dtype=torch.float64).exponential_(
        generator=_generator(seed, position, 0, generator))
    return int((weights.double() / noise.clamp_(min=torch.finfo(torch.float64).tiny)).argmax())
