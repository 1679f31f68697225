"""worker.step.sampler: greedy and filtered sampling against a float64 reference, stateless seeds, and
the logits processors in their place in the pipeline."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from proto import internal_pb2
from worker.step.sampler import Sampler, seed_for


def cfg(temperature=0.0, top_p=1.0, top_k=0, seed=None, **extra):
    c = internal_pb2.SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, **extra)
    if seed is not None:
        c.has_seed, c.seed = True, seed
    return c


@pytest.fixture
def sampler():
    return Sampler(torch.Generator().manual_seed(1234))


def test_greedy_is_argmax(sampler):
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    out = sampler(logits, [cfg()] * 6, [0] * 6)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_greedy_takes_the_first_of_tied_maxima_over_a_real_vocabulary(sampler):
    """Rows as wide as SmolLM2's vocabulary (the reduction's vector path), ties placed where its
    lanes and chunks split them, a row of -inf (a grammar's dead row) and a row with a NaN: the
    first index, as argmax and transformers' greedy give."""
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(3))
    for row, (a, b) in enumerate([(5, 40000), (16, 17), (0, 49151), (1023, 1024)]):
        logits[row, [a, b]] = 50.0
    logits[4] = float("-inf")
    logits[5, 777] = float("nan")
    out = sampler(logits, [cfg()] * 6, [0] * 6)
    assert out.tolist() == [5, 16, 0, 1023, 0, 777] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("params", [cfg(temperature=1.0, top_k=1), cfg(temperature=2.0, top_p=1e-6),
                                    cfg(temperature=1.0, top_k=1, seed=7)])
def test_degenerate_filters_are_argmax(sampler, params):
    logits = torch.randn(32, 500, generator=torch.Generator().manual_seed(1))
    out = sampler(logits, [params] * 32, list(range(32)))
    assert out.tolist() == logits.argmax(-1).tolist()


def test_mixed_batch_keeps_greedy_rows_greedy(sampler):
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    params = [cfg() if i % 2 == 0 else cfg(temperature=1.5) for i in range(8)]
    out = sampler(logits, params, [0] * 8)
    assert out[0::2].tolist() == logits[0::2].argmax(-1).tolist()


def test_seeded_draws_are_reproducible_and_independent_of_the_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 64, generator=g)
    seeded = cfg(temperature=1.0, top_p=0.95, seed=42)
    target = logits[2]
    # Alone, then third in a batch of strangers, with two different worker generators.
    alone = Sampler(torch.Generator().manual_seed(0))(target[None], [seeded], [17])
    params = [cfg(temperature=1.0), cfg(temperature=0.5, seed=9), seeded, cfg(), cfg(temperature=3.0)]
    batch = Sampler(torch.Generator().manual_seed(99))(logits, params, [3, 4, 17, 5, 6])
    assert int(batch[2]) == int(alone[0])
    # A different position is a different draw: over many positions the tokens vary.
    draws = {int(Sampler(torch.Generator())(target[None], [seeded], [p])[0]) for p in range(40)}
    assert len(draws) > 1
    assert seed_for(42, 17) != seed_for(42, 18) != seed_for(43, 17)


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The float64 definition: temperature, keep the top k, then the smallest most-likely set
    whose probability reaches top_p, renormalized."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x)
    keep = np.zeros_like(x, dtype=bool)
    keep[order[:top_k or len(x)]] = True
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    cum = np.cumsum(p[order])
    cutoff = int(np.searchsorted(cum, top_p)) + 1  # first index where the mass reaches top_p
    final = np.zeros_like(p)
    final[order[:cutoff]] = p[order[:cutoff]]
    return final / final.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0),
                                                     (0.8, 0, 0.75), (1.0, 6, 0.9)])
def test_distribution_matches_float64(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.5, -1.0, -2.0, -4.0])
    expected = reference_probs(logits.numpy(), temperature, top_k, top_p)
    n = 100_000
    sampler = Sampler(torch.Generator().manual_seed(5))
    out = sampler(logits.expand(n, -1).contiguous(), [cfg(temperature, top_p, top_k)] * n, [0] * n)
    freq = np.bincount(out.numpy(), minlength=len(logits)) / n
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= 5 * sigma + 1e-12), (freq, expected)
    assert np.all(freq[expected == 0] == 0)


def test_seeded_stream_follows_the_distribution():
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    expected = reference_probs(logits.numpy(), 1.0, 0, 1.0)
    n = 3000
    sampler = Sampler(torch.Generator())
    # One row per position of one seeded sequence: the per-position streams must be unbiased.
    out = sampler(logits.expand(n, -1).contiguous(), [cfg(1.0, seed=11)] * n, list(range(n)))
    freq = np.bincount(out.numpy(), minlength=4) / n
    assert np.all(np.abs(freq - expected) <= 5 * np.sqrt(expected * (1 - expected) / n))


# ---------------------------------------------------------------- logits processors in the pipeline

PROMPT = [1, 2, 3, 4]


def test_min_tokens_holds_stop_ids_back_until_reached(sampler):
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(6))
    logits[0, 7] = 50.0  # the stop id would win every draw
    logits[0, 9] = 40.0
    under = cfg(temperature=1.0, seed=3, min_tokens=3, stop_token_ids=[7, 9])
    for outputs in range(3):
        history = [PROMPT + [0] * outputs] * 64
        out = sampler(logits.expand(64, -1), [under] * 64, list(range(64)), history, [4] * 64)
        assert not set(out.tolist()) & {7, 9}
    greedy_under = cfg(min_tokens=3, stop_token_ids=[7, 9])
    masked = logits.clone()
    masked[0, [7, 9]] = float("-inf")
    assert int(sampler(logits, [greedy_under], [6], [PROMPT + [0, 0]], [4])[0]) == int(masked.argmax())
    reached = cfg(min_tokens=3, stop_token_ids=[7, 9])
    assert int(sampler(logits, [reached], [7], [PROMPT + [0, 0, 0]], [4])[0]) == 7
    # Without a history every row has zero outputs, so the mask applies.
    assert int(sampler(logits, [reached], [0])[0]) == int(masked.argmax())


def test_greedy_with_logit_bias_picks_the_biased_token(sampler):
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(7))
    low = int(logits[0].argmin())
    top = logits[1].topk(2).indices.tolist()
    params = [cfg(logit_bias={low: 100.0}), cfg(logit_bias={top[0]: -100.0}), cfg()]
    out = sampler(logits, params, [0] * 3)
    assert out.tolist() == [low, top[1], int(logits[2].argmax())]


def test_greedy_sees_the_penalties(sampler):
    logits = torch.tensor([[0.0, 2.0, 1.5, -1.0], [-3.0, -0.5, -0.6, -4.0], [0.0, 2.0, 1.5, -1.0]])
    params = [cfg(repetition_penalty=2.0), cfg(repetition_penalty=1.5), cfg(frequency_penalty=0.3)]
    # Row 0: token 1 is in the prompt, 2.0 / 2 loses to 1.5. Row 1: -0.5 * 1.5 loses to -0.6.
    # Row 2: token 1 came out twice, 2.0 - 0.6 loses to 1.5.
    out = sampler(logits, params, [5] * 3, [[1, 3], [1], [0, 1, 1]], [2, 1, 1])
    assert logits.argmax(-1).tolist() == [1, 1, 1]
    assert out.tolist() == [2, 2, 2]


def test_seeded_rows_with_every_processor_ignore_the_batch():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 200, generator=g)
    history = [torch.randint(0, 200, (12,), generator=g).tolist() for _ in range(6)]
    target = cfg(temperature=0.9, top_k=50, top_p=0.9, seed=21, min_p=0.05, repetition_penalty=1.3,
                 frequency_penalty=0.4, presence_penalty=0.2, logit_bias={5: 1.0, 17: -2.0},
                 min_tokens=20, stop_token_ids=[0])
    strangers = [cfg(temperature=1.2, presence_penalty=-1.0), cfg(logit_bias={3: 9.0}),
                 cfg(temperature=0.7, min_p=0.2, seed=4), cfg(temperature=1.0, top_k=3, repetition_penalty=0.5),
                 cfg(temperature=1.5, top_p=0.5, min_tokens=50, stop_token_ids=[1, 2])]
    draws = set()
    for position in range(30):
        one = Sampler(torch.Generator().manual_seed(0))(logits[2:3], [target], [position], history[2:3], [6])
        params = strangers[:2] + [target] + strangers[2:]
        batch = Sampler(torch.Generator().manual_seed(position))(logits, params, [position] * 6, history,
                                                                [6, 0, 6, 12, 3, 6])
        assert int(batch[2]) == int(one[0])
        draws.add(int(one[0]))
    assert len(draws) > 3  # really sampled, not a degenerate argmax


def reference_pipeline(logits: np.ndarray, p, history: list[int], num_prompt: int) -> np.ndarray:
    """The float64 definition of the whole pipeline in vLLM's order: min_tokens, logit_bias,
    penalties, temperature, min_p, top-k, top-p."""
    x = logits.astype(np.float64)
    outputs = np.asarray(history[num_prompt:], dtype=np.int64)
    if len(outputs) < p.min_tokens:
        x[list(p.stop_token_ids)] = -np.inf
    for tok, bias in p.logit_bias.items():
        x[tok] += bias
    counts = np.bincount(outputs, minlength=len(x))
    r = p.repetition_penalty
    seen = np.isin(np.arange(len(x)), history)
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    x = x / p.temperature
    probs = np.exp(x - x.max())
    x = np.where(probs < p.min_p * probs.max(), -np.inf, x)
    return reference_probs(x, 1.0, p.top_k, p.top_p)


PENALIZED = dict(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2,
                 logit_bias={6: 1.5, 2: -0.4}, min_tokens=5, stop_token_ids=[1])


# Each case has its filter (top-p, min-p, top-k) cut a token the others would keep; every
# processor, and the order (e.g. min-p after temperature, penalties before it), moves the result.
@pytest.mark.parametrize("params", [cfg(temperature=0.8, top_p=0.9, **PENALIZED),
                                    cfg(temperature=2.0, min_p=0.3, **PENALIZED),
                                    cfg(temperature=1.3, top_k=3, **PENALIZED)],
                         ids=["top_p", "min_p", "top_k"])
def test_full_pipeline_distribution_matches_float64(params):
    logits = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.5, -1.0, -2.0, -4.0])
    history, num_prompt = [0, 5, 0, 3, 3, 4], 3
    expected = reference_pipeline(logits.numpy(), params, history, num_prompt)
    n = 100_000
    out = Sampler(torch.Generator().manual_seed(9))(logits.expand(n, -1).contiguous(), [params] * n, [0] * n,
                                                    [history] * n, [num_prompt] * n)
    freq = np.bincount(out.numpy(), minlength=len(logits)) / n
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= 5 * sigma + 1e-12), (freq, expected)
    assert np.all(freq[expected == 0] == 0)
