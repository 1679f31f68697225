"""worker.step.logits: each processor against a float64 numpy reference of its formula and against
transformers' own processor where one exists; logprobs against a float64 log_softmax."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TopKLogitsWarper,
                          TopPLogitsWarper)

from proto import internal_pb2
from worker.step.logits import apply_logit_bias, apply_min_p, apply_min_tokens, apply_penalties, compute_logprobs
from worker.step.sampler import apply_top_k_top_p

VOCAB = 40  # small, so that histories repeat tokens
fast = settings(max_examples=60, deadline=None)


def f32(lo: float, hi: float):
    """Floats as the proto's float fields hold them, so the reference sees the same value."""
    return st.floats(lo, hi).map(lambda v: float(np.float32(v)))


def cfg(**fields) -> internal_pb2.SamplingConfig:
    return internal_pb2.SamplingConfig(**fields)


def random_logits(seed: int, rows: int, vocab: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, vocab)).astype(np.float32) * scale)


def check_pure(fn, logits: torch.Tensor, *args) -> torch.Tensor:
    """Runs fn and checks it left its input alone."""
    before = logits.clone()
    out = fn(logits, *args)
    assert torch.equal(logits, before)
    return out


def assert_close64(got: torch.Tensor, ref: np.ndarray) -> None:
    np.testing.assert_allclose(got.double().numpy(), ref, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- min_tokens

def ref_min_tokens(x: np.ndarray, params, num_outputs) -> np.ndarray:
    x = x.astype(np.float64)
    for i, (p, n) in enumerate(zip(params, num_outputs)):
        if n < p.min_tokens:
            x[i, list(p.stop_token_ids)] = -np.inf
    return x


rows_min_tokens = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6),
                                     st.lists(st.integers(0, VOCAB - 1), max_size=3, unique=True)),
                           min_size=1, max_size=6)


@fast
@given(seed=st.integers(0, 2**32 - 1), rows=rows_min_tokens)
def test_min_tokens_matches_reference(seed, rows):
    logits = random_logits(seed, len(rows))
    params = [cfg(min_tokens=m, stop_token_ids=stops) for m, _, stops in rows]
    num_outputs = [n for _, n, _ in rows]
    got = check_pure(apply_min_tokens, logits, params, num_outputs)
    assert_close64(got, ref_min_tokens(logits.numpy(), params, num_outputs))


def test_min_tokens_masks_only_rows_under_their_minimum():
    logits = random_logits(0, 4)
    params = [cfg(min_tokens=3, stop_token_ids=[5, 7])] * 3 + [cfg(stop_token_ids=[5])]
    got = apply_min_tokens(logits, params, [2, 3, 4, 0])
    assert torch.isneginf(got[0, [5, 7]]).all() and torch.isfinite(got[0]).sum() == VOCAB - 2
    assert torch.equal(got[1:], logits[1:])


# ---------------------------------------------------------------- logit_bias

def ref_logit_bias(x: np.ndarray, params) -> np.ndarray:
    x = x.astype(np.float64)
    for i, p in enumerate(params):
        for tok, bias in p.logit_bias.items():
            x[i, tok] += bias
    return x


@fast
@given(seed=st.integers(0, 2**32 - 1),
       biases=st.lists(st.dictionaries(st.integers(0, VOCAB - 1), f32(-100, 100), max_size=5),
                       min_size=1, max_size=6))
def test_logit_bias_matches_reference(seed, biases):
    logits = random_logits(seed, len(biases))
    params = [cfg(logit_bias=b) for b in biases]
    got = check_pure(apply_logit_bias, logits, params)
    assert_close64(got, ref_logit_bias(logits.numpy(), params))


# ---------------------------------------------------------------- penalties

def ref_penalties(x: np.ndarray, params, token_ids, num_prompt) -> np.ndarray:
    """vLLM's formulas, one row at a time."""
    x = x.astype(np.float64)
    for i, p in enumerate(params):
        ids = np.asarray(token_ids[i], dtype=np.int64)
        counts = np.bincount(ids[num_prompt[i]:], minlength=x.shape[1]).astype(np.float64)
        seen = np.isin(np.arange(x.shape[1]), ids)
        r = p.repetition_penalty if p.repetition_penalty > 0 else 1.0
        x[i] = np.where(seen, np.where(x[i] > 0, x[i] / r, x[i] * r), x[i])
        x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return x


penalty = st.one_of(st.just(0.0), f32(-2, 2))
rows_penalties = st.lists(st.tuples(
    st.one_of(st.just(0.0), st.just(1.0), f32(0.5, 2.5)), penalty, penalty,
    st.lists(st.integers(0, VOCAB - 1), max_size=12), st.lists(st.integers(0, VOCAB - 1), max_size=12)),
    min_size=1, max_size=6)


@fast
@given(seed=st.integers(0, 2**32 - 1), rows=rows_penalties)
def test_penalties_match_reference(seed, rows):
    logits = random_logits(seed, len(rows))
    params = [cfg(repetition_penalty=r, frequency_penalty=f, presence_penalty=p) for r, f, p, _, _ in rows]
    token_ids = [prompt + out for *_, prompt, out in rows]
    num_prompt = [len(prompt) for *_, prompt, _ in rows]
    got = check_pure(apply_penalties, logits, params, token_ids, num_prompt)
    assert_close64(got, ref_penalties(logits.numpy(), params, token_ids, num_prompt))


def test_penalty_counts_only_outputs_and_repetition_counts_both():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    # Token 0 is prompt only, token 1 prompt and output, token 2 twice in the output.
    params = [cfg(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)]
    got = apply_penalties(logits, params, [[0, 1, 1, 2, 2]], [2])
    assert got.tolist() == [[1.0, -4.0 - 0.25 - 0.5, 0.5 - 0.5 - 0.5, 0.5]]


@fast
@given(seed=st.integers(0, 2**32 - 1), rows=st.lists(st.tuples(
    f32(0.3, 3.0), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=15),
    st.integers(0, 15)), min_size=1, max_size=5))
def test_repetition_penalty_matches_transformers(seed, rows):
    logits = random_logits(seed, len(rows))
    params = [cfg(repetition_penalty=r) for r, _, _ in rows]
    token_ids = [ids for _, ids, _ in rows]
    num_prompt = [min(n, len(ids)) for _, ids, n in rows]
    got = apply_penalties(logits, params, token_ids, num_prompt)
    for i, (r, ids, _) in enumerate(rows):
        want = RepetitionPenaltyLogitsProcessor(float(r))(torch.tensor([ids]), logits[i:i + 1].clone())
        torch.testing.assert_close(got[i:i + 1], want, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- min_p

@fast
@given(seed=st.integers(0, 2**32 - 1),
       min_p=st.lists(st.one_of(st.just(0.0), f32(0.001, 1.0)), min_size=1, max_size=6))
def test_min_p_matches_reference_and_transformers(seed, min_p):
    logits = random_logits(seed, len(min_p), scale=2.0)
    got = check_pure(apply_min_p, logits, min_p)
    x = logits.numpy().astype(np.float64)
    probs = np.exp(x - x.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    threshold = np.asarray(min_p, dtype=np.float64)[:, None] * probs.max(1, keepdims=True)
    keep = probs >= threshold
    # float32 and float64 may disagree on a token sitting on the threshold: those prove nothing.
    clear = np.abs(probs - threshold) > 1e-6
    assert np.array_equal(np.isfinite(got.numpy())[clear], keep[clear])
    assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(got)])
    for i, m in enumerate(min_p):
        want = MinPLogitsWarper(float(m), min_tokens_to_keep=1)(None, logits[i:i + 1])
        assert torch.equal(got[i:i + 1], want)


# ---------------------------------------------------------------- top-k, top-p

def ref_top_k_top_p_keep(x: np.ndarray, k: int, p: float) -> tuple[np.ndarray, bool]:
    """Top k (0: all), then the smallest most-likely set whose probability reaches p (renormalized
    after top-k). Second value: whether the cut is clear of float32 rounding."""
    x = x.astype(np.float64)
    order = np.argsort(-x)
    kept = order[:k or len(x)]
    probs = np.exp(x[kept] - x[kept].max())
    probs /= probs.sum()
    before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])  # mass strictly more likely
    keep = np.zeros(len(x), dtype=bool)
    keep[kept[before < p]] = True
    return keep, bool(np.all(np.abs(before - p) > 1e-5))


@fast
@given(seed=st.integers(0, 2**32 - 1), rows=st.lists(st.tuples(
    st.one_of(st.just(0), st.integers(1, VOCAB + 5)),
    st.one_of(st.just(1.0), st.just(0.0), f32(0.05, 0.99))), min_size=1, max_size=6))
def test_top_k_top_p_matches_reference_and_transformers(seed, rows):
    logits = random_logits(seed, len(rows), scale=1.5)
    got = check_pure(apply_top_k_top_p, logits, [k for k, _ in rows], [p for _, p in rows])
    for i, (k, p) in enumerate(rows):
        on_p = 0.0 < p < 1.0
        keep, clear = ref_top_k_top_p_keep(logits[i].numpy(), k, p if on_p else 1.0)
        if clear:
            assert np.array_equal(torch.isfinite(got[i]).numpy(), keep)
        want = logits[i:i + 1]
        if k:
            want = TopKLogitsWarper(k, min_tokens_to_keep=1)(None, want)
        if on_p:
            want = TopPLogitsWarper(float(p), min_tokens_to_keep=1)(None, want)
        assert torch.equal(got[i:i + 1], want)


# ---------------------------------------------------------------- a batch that uses nothing

def test_nothing_to_do_returns_the_input_itself():
    logits = random_logits(1, 3)
    plain = [cfg(temperature=0.7, top_p=0.9, repetition_penalty=1.0, stop_token_ids=[3])] * 3
    history = [[1, 2, 3]] * 3
    assert apply_min_tokens(logits, plain, [0] * 3) is logits
    assert apply_logit_bias(logits, plain) is logits
    assert apply_penalties(logits, plain, history, [1] * 3) is logits
    assert apply_min_p(logits, [p.min_p for p in plain]) is logits
    # A penalty with no history to penalize is no work either.
    assert apply_penalties(logits, [cfg(frequency_penalty=1.0)] * 3, [[]] * 3, [0] * 3) is logits


# ---------------------------------------------------------------- logprobs

def ref_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(1, keepdims=True))


@fast
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 6), k=st.integers(0, 8))
def test_logprobs_match_float64(seed, rows, k):
    logits = random_logits(seed, rows, vocab=500, scale=4.0)
    tokens = torch.from_numpy(np.random.default_rng(seed + 1).integers(0, 500, rows))
    lp, ranks, top_ids, top_lp = compute_logprobs(logits, tokens, k)
    assert (lp.dtype, ranks.dtype, top_ids.dtype, top_lp.dtype) == (torch.float32, torch.int64,
                                                                     torch.int64, torch.float32)
    assert top_ids.shape == top_lp.shape == (rows, k)
    ref = ref_log_softmax(logits.numpy())
    chosen = ref[np.arange(rows), tokens.numpy()]
    assert_close64(lp, chosen)
    assert ranks.tolist() == (1 + (ref > chosen[:, None]).sum(1)).tolist()
    assert top_ids.tolist() == np.argsort(-ref, axis=1, kind="stable")[:, :k].tolist()
    assert_close64(top_lp, np.take_along_axis(ref, top_ids.numpy(), 1))


def test_logprobs_rank_counts_only_strictly_better_tokens():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 2.0]])
    _, ranks, top_ids, _ = compute_logprobs(logits.expand(5, -1), torch.arange(5), 2)
    assert ranks.tolist() == [5, 1, 1, 3, 3]
    assert sorted(top_ids[0].tolist()) == [1, 2]


def test_logprobs_of_bf16_logits_are_computed_in_float32():
    logits = (random_logits(7, 3, vocab=2000, scale=8.0)).bfloat16()
    tokens = torch.tensor([0, 1999, 1000])
    lp, _, top_ids, top_lp = compute_logprobs(logits, tokens, 3)
    ref = ref_log_softmax(logits.float().numpy())
    assert lp.dtype == top_lp.dtype == torch.float32
    assert_close64(lp, ref[np.arange(3), tokens.numpy()])
    assert_close64(top_lp, np.take_along_axis(ref, top_ids.numpy(), 1))


def test_logprobs_leave_the_logits_alone():
    logits = random_logits(3, 2)
    check_pure(compute_logprobs, logits, torch.tensor([0, 1]), 4)


@pytest.mark.parametrize("k", [0, VOCAB])
def test_logprobs_k_bounds(k):
    logits = random_logits(4, 2)
    _, _, top_ids, top_lp = compute_logprobs(logits, torch.tensor([0, 1]), k)
    assert top_ids.shape == top_lp.shape == (2, k)
    if k == VOCAB:  # the whole distribution, best first
        assert top_lp.exp().sum(1).tolist() == pytest.approx([1.0, 1.0])
        assert (top_lp[:, :-1] >= top_lp[:, 1:]).all()
