"""The rejection sampler (worker/speculation/rejection_sampler.py) against the target distribution: over many
draws, each output position's tokens are distributed as the target's probabilities there
(chi-square), for a draft distribution and for one-hot (n-gram) proposals, at several
temperatures and top-p values; greedy follows the argmax exactly; seeded draws repeat."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from worker.speculation.rejection_sampler import verify

V = 6
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0],
                       [0.0, 1.5, -1.0, 0.7, 0.2, -0.3],
                       [1.0, 1.0, 0.2, -2.0, 0.4, 0.9]], dtype=torch.float64)
DRAFT_LOGITS = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0, 0.0],
                             [1.0, 0.0, 0.0, 0.0, 2.0, 0.0]], dtype=torch.float64)
DRAWS = 12000


def target(temperature: float, top_p: float) -> torch.Tensor:
    """What the sampler's processors leave: softmax at the temperature, outside top-p zeroed."""
    p = (LOGITS / temperature).softmax(-1)
    order = p.argsort(-1, descending=True)
    kept = (p.gather(-1, order).cumsum(-1) - p.gather(-1, order)) < top_p
    mask = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, order, kept)
    p = p * mask
    return p / p.sum(-1, keepdim=True)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.6, 1.0), (1.5, 0.8)])
@pytest.mark.parametrize("proposer", ["draft model", "n-gram"])
def test_every_output_position_has_the_targets_distribution(temperature, top_p, proposer):
    probs = target(temperature, top_p)
    draft_probs = DRAFT_LOGITS.softmax(-1) if proposer == "draft model" else None
    g = torch.Generator().manual_seed(1234)
    counts = np.zeros((3, V))
    # Every draw's proposals, drawn at once: fixed ones as a lookup makes them (likely ones), or
    # the draft distribution's.
    drafts = ([[0, 1]] * DRAWS if draft_probs is None else
              torch.multinomial(draft_probs, DRAWS, replacement=True, generator=g).T.tolist())
    for draft in drafts:
        out = verify(probs, draft, draft_probs, greedy=False, seed=None, first_position=10, generator=g)
        assert out.tokens[:out.accepted] == draft[:out.accepted] and len(out.tokens) == out.accepted + 1
        for i, t in enumerate(out.tokens):
            counts[i, t] += 1
    for i in range(3):  # position i is reached when every proposal before it was accepted
        n = counts[i].sum()
        expected = probs[i].numpy() * n
        support = expected > 0
        assert counts[i][~support].sum() == 0  # nothing outside top-p, ever
        if n >= 500:
            stat = chisquare(counts[i][support], expected[support])
            assert stat.pvalue > 1e-3, (i, counts[i], expected)
    assert counts[2].sum() > 500  # the bonus position is reached often enough to be tested


def test_greedy_accepts_while_the_proposal_is_the_argmax():
    probs = target(1.0, 1.0)  # argmax rows: 0, 1, 0
    assert verify(probs, [0, 1], None, True, None, 0).tokens == [0, 1, 0]
    out = verify(probs, [0, 3], None, True, None, 0)
    assert (out.tokens, out.accepted) == ([0, 1], 1)
    out = verify(probs, [2, 1], DRAFT_LOGITS.softmax(-1), True, None, 0)
    assert (out.tokens, out.accepted) == ([0], 0)


def test_seeded_draws_depend_on_seed_and_position_alone():
    probs, draft_probs = target(1.0, 1.0), DRAFT_LOGITS.softmax(-1)
    runs = [verify(probs, [1, 4], draft_probs, False, seed, 7).tokens
            for seed in range(200) for _ in range(2)]
    assert runs[0::2] == runs[1::2]  # each seed twice: the same output
    assert len({tuple(r) for r in runs}) > 5  # and the seeds differ
    shifted = [verify(probs, [1, 4], draft_probs, False, seed, 8).tokens for seed in range(200)]
    assert shifted != runs[0::2]


class _Seeded:  # the SamplingConfig fields Sampler reads
    def __init__(self, seed: int) -> None:
        self.temperature, self.top_p, self.top_k, self.min_p = 1.0, 1.0, 0, 0.0
        self.has_seed, self.seed = True, seed
        self.presence_penalty = self.frequency_penalty = 0.0
        self.repetition_penalty, self.logit_bias, self.min_tokens = 1.0, {}, 0


def test_seeded_n_gram_runs_are_the_tokens_the_plain_sampler_gives():
    """One-hot proposals verified by drawing each position as the sampler draws it: a seeded
    row's run is, token for token, what decoding one token a step gives at those positions,
    whatever the proposals were (they decide only how far the run goes)."""
    from worker.step.sampler import Sampler
    logits = LOGITS.float()
    probs = logits.softmax(-1)
    sampler = Sampler(torch.Generator().manual_seed(0))
    for seed in range(60):
        plain = [int(sampler(logits[i:i + 1], [_Seeded(seed)], [5 + i])[0]) for i in range(3)]
        for draft in ([plain[0], plain[1]], [plain[0], (plain[1] + 1) % V], [(plain[0] + 1) % V, 0]):
            out = verify(probs, draft, None, False, seed, 5)
            n = out.accepted
            assert out.tokens == plain[:n + 1] and draft[:n] == plain[:n]
            assert n == 2 or draft[n] != plain[n]
